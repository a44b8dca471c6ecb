//! The subcommands. Each takes the plain options [`crate::cli`] built from the flags, calls the
//! library, and prints: results on stdout, progress and summaries on stderr. Nothing here parses
//! flags, and nothing below here prints.

pub(crate) mod convert;
pub(crate) mod inspect;
pub(crate) mod verify;

use std::io::Write;
use std::path::Path;

use crate::error::{Error, Result};
use crate::exec::{self, IoMode};

/// How a command that reads every byte runs: `--threads`, `--io`.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Run {
    /// Worker threads; 0 means one per core.
    pub threads: usize,
    pub io: IoMode,
}

/// Write results to stdout through one buffer. A reader that goes away (`ckpt inspect X | head`)
/// ends the output normally, as for any Unix filter; other write errors are errors.
pub(crate) fn to_stdout(write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>) -> Result<()> {
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    match write(&mut out).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        Err(e) => Err(Error::io(Path::new("<stdout>"), e)),
        Ok(()) => Ok(()),
    }
}

/// Write one line to stderr. A closed stderr (`ckpt ... 2>&1 | head`) drops it instead of panicking
/// as `eprintln!` does: the line is a message about the run, whose exit code still tells how it went.
pub fn to_stderr(line: std::fmt::Arguments) {
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// Text for a terminal: names come from checkpoints, and a raw ESC or BEL in one could drive the
/// user's terminal, so control characters (other than newlines) are shown escaped.
pub fn terminal_safe(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_control() && c != '\n' {
                c.escape_unicode().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// This process's command line with the `--part` value shown as `I/N`: the same command for
/// every part, for hints.
pub(crate) fn command_line(count: usize) -> String {
    let mut out = Vec::new();
    // Lossy: this is for a hint, and `args()` would panic on an argument that is not UTF-8.
    let mut args = std::env::args_os().map(|a| a.to_string_lossy().into_owned());
    while let Some(a) = args.next() {
        if a == "--part" {
            args.next();
            out.push(format!("--part I/{count}"));
        } else if a.starts_with("--part=") {
            out.push(format!("--part I/{count}"));
        } else if a.is_empty()
            || a.contains(|c: char| !(c.is_ascii_alphanumeric() || "-_./=:,@+".contains(c)))
        {
            out.push(format!("'{}'", a.replace('\'', "'\\''")));
        } else {
            out.push(a);
        }
    }
    out.join(" ")
}

/// An indicatif bar on stderr, or nothing.
pub(crate) struct Bar(Option<indicatif::ProgressBar>);

impl Bar {
    pub(crate) fn new(show: bool) -> Bar {
        Bar(show.then(|| {
            let bar = indicatif::ProgressBar::new(0);
            if let Ok(style) = indicatif::ProgressStyle::with_template(
                "{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
            ) {
                bar.set_style(style);
            }
            bar
        }))
    }
}

impl exec::Progress for Bar {
    fn start(&self, total: u64) {
        if let Some(b) = &self.0 {
            b.set_length(total);
        }
    }
    fn advance(&self, bytes: u64) {
        if let Some(b) = &self.0 {
            b.inc(bytes);
        }
    }
    fn finish(&self) {
        if let Some(b) = &self.0 {
            b.finish_and_clear();
        }
    }
}
