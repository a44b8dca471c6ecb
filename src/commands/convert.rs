//! `ckpt consolidate` and `ckpt reshard`: one [`Conversion`] each, run with a progress bar and
//! told on stderr. The two differ only in the [`crate::convert::Layout`] they write.

use std::time::Instant;

use super::{terminal_safe, to_stderr, Bar, Run};
use crate::convert::{Conversion, Layout, Written};
use crate::error::{Error, Result};
use crate::exec::ExecOptions;
use crate::inspect::human_bytes;
use crate::output::part::Finished;
use crate::output::Done;

/// Run a conversion (consolidate, reshard) with a progress bar unless `quiet`, and tell how it
/// went on stderr.
pub(crate) fn run(
    job: &Conversion,
    run: Run,
    quiet: bool,
    cancel: &std::sync::atomic::AtomicBool,
) -> Result<i32> {
    use std::io::IsTerminal;
    let started = Instant::now();
    let bar = Bar::new(!quiet && std::io::stderr().is_terminal());
    let opts = ExecOptions {
        threads: run.threads,
        io: run.io,
        progress: &bar,
        cancel,
        // Outputs are made durable before they commit.
        durable: true,
    };
    let summary = crate::convert::convert(job, &opts)?;
    if quiet {
        return Ok(0);
    }
    for note in &summary.notes {
        to_stderr(format_args!("note: {}", terminal_safe(note)));
    }
    let secs = started.elapsed().as_secs_f64();
    let what = match &summary.written {
        Written::Tensors(n) => format!("{n} tensors"),
        Written::DeepSpeed {
            stage, from_world, ..
        } => {
            let world = match job.layout {
                Layout::DeepSpeed { world } => world,
                _ => return Err(Error::bug("a DeepSpeed summary of another layout")),
            };
            format!("ZeRO stage {stage} from {from_world} to {world} data-parallel ranks")
        }
    };
    match summary.done {
        Done::Whole { path, files, bytes } => to_stderr(format_args!(
            "wrote {what} to `{}`: {} file{}, {} copied in {:.2} s ({}/s)",
            terminal_safe(&path.display().to_string()),
            files,
            if files == 1 { "" } else { "s" },
            human_bytes(bytes),
            secs,
            human_bytes((bytes as f64 / secs.max(1e-9)) as u64)
        )),
        Done::Part {
            part,
            bytes,
            total,
            files,
            staging,
            final_path,
            finished,
        } => {
            let status = match &finished {
                Finished::Waiting { missing } => format!(
                    "{} of {} parts still missing: {}",
                    missing.len(),
                    part.count,
                    missing
                        .iter()
                        .map(|i| i.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                Finished::Committed => format!(
                    "all {} parts done: committed {what} to `{}`",
                    part.count,
                    final_path.display()
                ),
                Finished::CommittedElsewhere { by } => {
                    format!("all {} parts done: {} commits", part.count, by.trim())
                }
            };
            to_stderr(format_args!(
                "part {part}: wrote {} of {} ({} file{}) into `{}` in {secs:.2} s; {}",
                human_bytes(bytes),
                human_bytes(total),
                files,
                if files == 1 { "" } else { "s" },
                terminal_safe(&staging.display().to_string()),
                terminal_safe(&status)
            ));
        }
    }
    Ok(0)
}
