//! Command-line interface: flags (clap derive) in, library calls, printing and exit codes out.
//! clap types stay in this module.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use clap::{CommandFactory, Parser, Subcommand, ValueEnum};

use crate::convert::Done;
use crate::detect::Source;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::exec::{self, ExecOptions, IoMode};
use crate::geometry::Placement;
use crate::inspect::human_bytes;
use crate::layout::ReadOptions;
use crate::model::Checkpoint;
use crate::output::part::Finished;
use crate::output::OutputKind;
use crate::part::PartSpec;
use crate::plan::{MeshSpec, Target};
use crate::select::Selection;
use crate::verify::{self, VerifyOptions};

#[derive(Parser, Debug)]
#[command(
    name = "ckpt",
    version,
    about = "Convert PyTorch checkpoints between FULL and SHARDED layouts, without torch"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Names and shapes for an FSDP1 LOCAL_STATE_DICT checkpoint, in module order: a FULL
    /// torch.save of model.state_dict(), a JSON list [[name, shape], ...] of
    /// model.named_parameters(), or a SHARDED checkpoint of the same model.
    #[arg(long, global = true, value_name = "REF")]
    shapes_from: Option<PathBuf>,
    /// Which saved tag to read where a checkpoint directory holds several (DeepSpeed's
    /// `global_stepN`, Megatron-LM's iteration `N` or `iter_NNNNNNN`); by default the one its
    /// `latest` (`latest_checkpointed_iteration.txt`) file names.
    #[arg(long, global = true, value_name = "TAG")]
    tag: Option<String>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Describe a checkpoint: layout, world size, every tensor and non-tensor entry.
    Inspect(InspectArgs),
    /// Check that a checkpoint is sound. Exit 0 sound, 1 problems found, 2 usage error.
    Verify(VerifyArgs),
    /// Write a FULL state dict: safetensors (one file or Hugging Face split files) or torch.save.
    Consolidate(ConsolidateArgs),
    /// Write a SHARDED state dict for a new world size or mesh, loadable by `dcp.load`.
    Reshard(ReshardArgs),
    /// Print a completion script for bash, zsh, fish, elvish or powershell.
    ///
    /// e.g. `ckpt generate-shell-completion bash > ~/.local/share/bash-completion/completions/ckpt`
    GenerateShellCompletion(CompletionArgs),
}

#[derive(clap::Args, Debug)]
struct InspectArgs {
    /// A checkpoint file or directory, or every rank's file of a per-rank save.
    #[arg(required = true, num_args = 1.., value_name = "PATH", value_parser = crate::storage::parse_location)]
    path: Vec<PathBuf>,
    /// Print the stable JSON document instead of a table.
    #[arg(long)]
    json: bool,
    /// Only entries whose name matches this glob (repeatable).
    #[arg(long = "filter", value_name = "GLOB")]
    filters: Vec<String>,
    /// PEFT's `adapter_config.json` (or its directory): show each LoRA adapter's alpha too.
    #[arg(long, value_name = "CONFIG")]
    lora_config: Option<PathBuf>,
    /// A Hugging Face model directory or its config.json: show how `consolidate --hf-config`
    /// would map each tensor, and what it would leave out, instead of the checkpoint.
    #[arg(long, value_name = "HF", conflicts_with = "lora_config")]
    hf_config: Option<PathBuf>,
}

#[derive(clap::Args, Debug)]
struct VerifyArgs {
    /// A checkpoint file or directory, or every rank's file of a per-rank save.
    #[arg(required = true, num_args = 1.., value_name = "PATH", value_parser = crate::storage::parse_location)]
    path: Vec<PathBuf>,
    #[arg(long)]
    json: bool,
    /// Read every byte: per-tensor checksums, NaN/Inf warnings.
    #[arg(long)]
    deep: bool,
    /// Compare the logical tensors with another checkpoint, in any layout.
    #[arg(long, value_name = "OTHER", value_parser = crate::storage::parse_location)]
    against: Option<PathBuf>,
    /// Record per-tensor checksums (xxh3) in FILE, for a later `--manifest` check.
    #[arg(long, value_name = "FILE", value_parser = crate::storage::parse_location)]
    write_manifest: Option<PathBuf>,
    /// Check the tensors against a manifest written by `--write-manifest`, in any layout.
    #[arg(long, value_name = "FILE", conflicts_with = "write_manifest", value_parser = crate::storage::parse_location)]
    manifest: Option<PathBuf>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(clap::Args, Debug)]
struct ConsolidateArgs {
    /// A checkpoint file or directory, or every rank's file of a per-rank save.
    #[arg(required = true, num_args = 1.., value_name = "PATH", value_parser = crate::storage::parse_location)]
    path: Vec<PathBuf>,
    /// `NAME.safetensors` for one file, a directory for split files, `NAME.bin`/`.pt` with
    /// `--format torch`.
    #[arg(short, long, value_parser = crate::storage::parse_location)]
    output: PathBuf,
    #[arg(long, value_enum)]
    format: Option<FullFormat>,
    /// Split into files of at most this size (`5GB`, `500MB`, `2GiB`); implies a directory.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    max_shard_size: Option<u64>,
    /// Write a Hugging Face model directory for this model: its directory (config.json,
    /// tokenizer files, generation_config.json) or its config.json. Tensors are named and laid
    /// out as `architectures[0]` has them; training state is left out.
    #[arg(long, value_name = "HF", conflicts_with = "format")]
    hf_config: Option<PathBuf>,
    /// Quantize the export's linear weights (attention, MLPs, experts): `fp8-block` writes each
    /// as F8_E4M3 with an F32 `weight_scale_inv` per 128×128 tile, as DeepSeek-V3 and
    /// Qwen3-FP8 ship; the rest stays in --dtype. Needs --hf-config.
    #[arg(long, value_enum, value_name = "KIND")]
    quantize: Option<Quantize>,
    #[command(flatten)]
    lora: LoraArgs,
    #[command(flatten)]
    select: SelectArgs,
    #[command(flatten)]
    run: RunArgs,
    #[command(flatten)]
    write: WriteArgs,
}

#[derive(clap::Args, Debug)]
struct ReshardArgs {
    /// A checkpoint file or directory, or every rank's file of a per-rank save.
    #[arg(required = true, num_args = 1.., value_name = "PATH", value_parser = crate::storage::parse_location)]
    path: Vec<PathBuf>,
    #[arg(short, long, value_parser = crate::storage::parse_location)]
    output: PathBuf,
    /// Shorthand for `--mesh N --placements 'S(0)'`.
    #[arg(long, conflicts_with = "mesh")]
    world_size: Option<usize>,
    /// Mesh shape, e.g. `4` or `2x4`.
    #[arg(long, requires = "placements")]
    mesh: Option<String>,
    /// One placement per mesh dimension: `S(d)` shards tensor dim d, `R` replicates.
    #[arg(long)]
    placements: Option<String>,
    /// Store tensors matching this glob whole, once (repeatable).
    #[arg(long, value_name = "GLOB")]
    replicate: Vec<String>,
    #[arg(long, value_enum, default_value = "dcp")]
    format: ShardedFormat,
    #[command(flatten)]
    lora: LoraArgs,
    #[command(flatten)]
    select: SelectArgs,
    #[command(flatten)]
    run: RunArgs,
    #[command(flatten)]
    write: WriteArgs,
}

#[derive(clap::Args, Debug)]
struct CompletionArgs {
    #[arg(value_enum)]
    shell: clap_complete::Shell,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Quantize {
    /// Blockwise FP8 (E4M3, 128×128 tiles).
    Fp8Block,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum FullFormat {
    Safetensors,
    Torch,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum ShardedFormat {
    Dcp,
    DcpSafetensors,
    /// A DeepSpeed ZeRO checkpoint (input: DeepSpeed, stages 0-3) at `--world-size` ranks.
    Deepspeed,
}

#[derive(clap::Args, Debug)]
struct LoraArgs {
    /// Fold a LoRA adapter into the base weights: PEFT's `adapter_config.json` or the directory
    /// holding it (and, if there, `adapter_model.safetensors` with the adapter's tensors).
    #[arg(long, value_name = "CONFIG")]
    merge_lora: Option<PathBuf>,
    /// Which of the checkpoint's LoRA adapters to merge, when it holds several.
    #[arg(long, value_name = "NAME", requires = "merge_lora")]
    adapter: Option<String>,
}

#[derive(clap::Args, Debug)]
struct SelectArgs {
    /// Keep only tensors whose name matches (repeatable).
    #[arg(long, value_name = "GLOB")]
    include: Vec<String>,
    /// Drop tensors whose name matches (repeatable).
    #[arg(long, value_name = "GLOB")]
    exclude: Vec<String>,
    /// Remove this prefix from names, e.g. `model.` or `_orig_mod.` (repeatable; first match wins).
    #[arg(long, value_name = "PREFIX")]
    strip_prefix: Vec<String>,
    /// Cast floating-point tensors (integer and bool tensors are left alone).
    #[arg(long, value_enum)]
    dtype: Option<CastTo>,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum CastTo {
    Bf16,
    Fp16,
    Fp32,
}

#[derive(clap::Args, Debug)]
struct RunArgs {
    /// Worker threads (default: one per core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// How inputs are read: `mmap` (local disks) or `read` (network filesystems).
    #[arg(long, value_enum, default_value = "mmap")]
    io: Io,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Io {
    Mmap,
    Read,
}

#[derive(clap::Args, Debug)]
struct WriteArgs {
    /// Replace an existing output.
    #[arg(long)]
    force: bool,
    /// No progress bar and no summary.
    #[arg(short, long)]
    quiet: bool,
    /// Do part I of N (0-based, as `$SLURM_ARRAY_TASK_ID` or `$JOB_COMPLETION_INDEX`): a share of
    /// the output's bytes, staged beside it; the part that finds all N done commits the output.
    #[arg(long, value_name = "I/N", value_parser = parse_part)]
    part: Option<PartSpec>,
}

fn parse_part(s: &str) -> std::result::Result<PartSpec, String> {
    s.parse()
}

/// Write results to stdout through one buffer. A reader that goes away (`ckpt inspect X | head`)
/// ends the output normally, as for any Unix filter; other write errors are errors.
fn to_stdout(write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>) -> Result<()> {
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

/// Exit codes: 0 success, 1 problems found or failure, 2 usage error; the binary exits 130
/// (SIGINT) or 143 (SIGTERM) when interrupted (see [`crate::interrupt`]).
pub fn run(cli: Cli, cancel: &AtomicBool) -> Result<i32> {
    let reading = Reading {
        shapes_from: cli.shapes_from.as_deref(),
        tag: cli.tag.as_deref(),
    };
    match cli.command {
        Command::Inspect(args) => inspect(args, reading),
        Command::Verify(args) => verify(args, reading),
        Command::Consolidate(args) => consolidate(args, reading, cancel),
        Command::Reshard(args) => reshard(args, reading, cancel),
        Command::GenerateShellCompletion(args) => completion(args),
    }
}

/// `ckpt generate-shell-completion SHELL`: the script clap_complete derives from these flags.
fn completion(args: CompletionArgs) -> Result<i32> {
    // Generated into memory first: clap_complete panics on a failed write, and a closed stdout
    // must end quietly like every other command's.
    let mut script = Vec::new();
    clap_complete::generate(args.shell, &mut Cli::command(), "ckpt", &mut script);
    to_stdout(|out| out.write_all(&script))?;
    Ok(0)
}

/// `ckpt inspect`: the report as a table or as JSON.
fn inspect(args: InspectArgs, reading: Reading) -> Result<i32> {
    let mut ckpt = read(&Source::new(args.path)?, reading, false)?;
    if let Some(hf) = &args.hf_config {
        let sel = Selection::new(&args.filters, &[], &[])?;
        let ckpt = sel.apply(ckpt)?;
        let cfg = crate::hf_export::HfConfig::read(hf)?;
        let mapping = crate::hf_export::map(&ckpt, &cfg)?;
        let report = crate::hf_export::report::report(&mapping);
        to_stdout(|out| {
            if args.json {
                serde_json::to_writer_pretty(&mut *out, &report)?;
                writeln!(out)
            } else {
                let text = crate::hf_export::report::render(&report);
                write!(out, "{}", terminal_safe(&text))
            }
        })?;
        return Ok(0);
    }
    let lora = match &args.lora_config {
        Some(path) => Some(crate::lora::config::read(path)?.0),
        None => None,
    };
    let adapters = crate::lora::describe(&ckpt, lora.as_ref());
    ckpt.details.extend(adapters);
    let sel = Selection::new(&args.filters, &[], &[])?;
    let report = crate::inspect::report(&ckpt, &|name| sel.keeps(name));
    to_stdout(|out| {
        if args.json {
            serde_json::to_writer_pretty(&mut *out, &report)?;
            writeln!(out)
        } else {
            write!(out, "{}", terminal_safe(&crate::inspect::render(&report)))
        }
    })?;
    Ok(0)
}

/// `ckpt verify`: the checkpoint's problems, then (if it is sound) the comparisons and manifests
/// that need its data. Exit 1 when anything was found.
fn verify(args: VerifyArgs, reading: Reading) -> Result<i32> {
    let VerifyArgs {
        path,
        json,
        deep,
        against,
        write_manifest,
        manifest,
        run,
    } = args;
    let opts = VerifyOptions {
        deep,
        threads: run.threads,
        io: run.io.into(),
        shapes_from: reading.shapes_from,
        tag: reading.tag,
    };
    let input = Source::new(path)?;
    let mut report = verify::verify_input(&input, &opts)?;
    let needs_data = against.is_some() || write_manifest.is_some() || manifest.is_some();
    if needs_data && report.is_sound() {
        let ckpt = read(&input, reading, false)?;
        if let Some(other) = &against {
            let b = read(&Source::one(other), reading, false)?;
            report
                .problems
                .extend(verify::compare(&ckpt, &b, &opts, 20)?);
        }
        if let Some(file) = &write_manifest {
            let m = verify::manifest(&ckpt, &opts)?;
            let text = serde_json::to_string_pretty(&m).unwrap_or_default() + "\n";
            if crate::storage::is_remote(file) {
                crate::storage::put(file, text.into_bytes())?;
            } else {
                write_small_file(file, text.as_bytes())?;
            }
        }
        if let Some(file) = &manifest {
            let text = crate::storage::read(file)?;
            let want: verify::Manifest = serde_json::from_slice(&text).map_err(|e| {
                Error::usage(format!("`{}` is not a ckpt manifest: {e}", file.display()))
            })?;
            report.problems.extend(verify::check_manifest(
                &want,
                &verify::manifest(&ckpt, &opts)?,
            ));
        }
    }
    to_stdout(|out| {
        if json {
            serde_json::to_writer_pretty(&mut *out, &report)?;
            return writeln!(out);
        }
        for p in &report.problems {
            writeln!(out, "{}", terminal_safe(&p.line()))?;
            if let Some(hint) = &p.hint {
                writeln!(out, "  hint: {}", terminal_safe(hint))?;
            }
        }
        let verdict = if report.is_sound() {
            "sound"
        } else {
            "NOT sound"
        };
        if let Some(u) = &report.unfinished {
            writeln!(
                out,
                "{}: {verdict} (unfinished: {} of {} parts done)",
                input.display(),
                u.done.len(),
                u.parts
            )
        } else if report.format.is_none() {
            writeln!(out, "{}: {verdict} (it could not be read)", input.display())
        } else {
            writeln!(
                out,
                "{}: {verdict} ({} tensors, {} pieces, {}{})",
                input.display(),
                report.tensors,
                report.pieces,
                human_bytes(report.bytes),
                if deep { ", every byte read" } else { "" }
            )
        }
    })?;
    Ok(if report.is_sound() { 0 } else { 1 })
}

/// `ckpt consolidate`: the FULL target follows from `--format`, `--max-shard-size` and the
/// output's name.
fn consolidate(args: ConsolidateArgs, reading: Reading, cancel: &AtomicBool) -> Result<i32> {
    let name = args
        .output
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default()
        .to_string();
    let (target, kind) = match (args.format, args.max_shard_size) {
        // A model directory, split as `save_pretrained` splits it.
        _ if args.hf_config.is_some() => (
            Target::SafetensorsSplit {
                max_shard_bytes: args.max_shard_size.unwrap_or(5_000_000_000),
            },
            OutputKind::Dir,
        ),
        (Some(FullFormat::Torch), Some(_)) => {
            return Err(Error::usage(
                "--max-shard-size applies to safetensors output only",
            ))
        }
        (Some(FullFormat::Torch), None) => {
            (Target::TorchSave { file_name: name }, OutputKind::File)
        }
        (_, Some(max)) => (
            Target::SafetensorsSplit {
                max_shard_bytes: max,
            },
            OutputKind::Dir,
        ),
        (_, None) if name.ends_with(".safetensors") => {
            (Target::Safetensors { file_name: name }, OutputKind::File)
        }
        (None, None)
            if name.ends_with(".bin") || name.ends_with(".pt") || name.ends_with(".pth") =>
        {
            (Target::TorchSave { file_name: name }, OutputKind::File)
        }
        // Hugging Face's default shard size.
        (_, None) => (
            Target::SafetensorsSplit {
                max_shard_bytes: 5_000_000_000,
            },
            OutputKind::Dir,
        ),
    };
    if args.quantize.is_some() && args.hf_config.is_none() {
        return Err(crate::fp8::needs_hf_config());
    }
    let input = Source::new(args.path)?;
    let job = Conversion {
        input: &input,
        reading,
        output: &args.output,
        kind,
        lora: &args.lora,
        hf_config: args.hf_config.as_deref(),
        fp8_block: args.quantize == Some(Quantize::Fp8Block),
        select: &args.select,
        run: &args.run,
        write: &args.write,
        cancel,
    };
    convert(&job, |_| target)
}

/// `ckpt reshard`: a SHARDED target over a mesh, some tensors possibly replicated whole.
fn reshard(args: ReshardArgs, reading: Reading, cancel: &AtomicBool) -> Result<i32> {
    if let ShardedFormat::Deepspeed = args.format {
        return reshard_deepspeed(&args, reading);
    }
    let (shape, placements) = match (args.world_size, &args.mesh) {
        (Some(n), _) => (vec![n], vec![Placement::Shard(0)]),
        (None, Some(m)) => (
            parse_mesh(m)?,
            parse_placements(args.placements.as_deref().unwrap_or_default())?,
        ),
        (None, None) => {
            return Err(Error::usage(
                "give --world-size N or --mesh AxB --placements ...",
            ))
        }
    };
    if shape.len() != placements.len() || shape.contains(&0) {
        return Err(Error::usage(format!(
            "the mesh {shape:?} needs one placement per dimension and no zero size, got {} placements",
            placements.len()
        )));
    }
    let replicate = &args.replicate;
    let ckpt_names = Selection::new(replicate, &[], &[])?;
    let mut spec = MeshSpec {
        shape,
        placements,
        replicated: Default::default(),
    };
    let format = args.format;
    // Resolved after selection (names may be renamed), in `convert`.
    let target_of = move |ckpt: &crate::model::Checkpoint| {
        if !replicate.is_empty() {
            spec.replicated = ckpt
                .tensors
                .iter()
                .filter(|t| ckpt_names.keeps(&t.name))
                .map(|t| t.name.clone())
                .collect();
        }
        match format {
            ShardedFormat::Dcp => Target::Dcp(spec),
            ShardedFormat::DcpSafetensors => Target::DcpSafetensors(spec),
            // Handled before: `reshard_deepspeed`.
            ShardedFormat::Deepspeed => Target::Dcp(spec),
        }
    };
    let input = Source::new(args.path)?;
    let job = Conversion {
        input: &input,
        reading,
        output: &args.output,
        kind: OutputKind::Dir,
        lora: &args.lora,
        hf_config: None,
        fp8_block: false,
        select: &args.select,
        run: &args.run,
        write: &args.write,
        cancel,
    };
    convert(&job, target_of)
}

/// `ckpt reshard --format deepspeed`: the DeepSpeed checkpoint as DeepSpeed saves it on
/// `--world-size` ranks. Its tensors are DeepSpeed's flat partitions, so the flags that select,
/// rename, cast or merge tensors do not apply.
fn reshard_deepspeed(args: &ReshardArgs, reading: Reading) -> Result<i32> {
    let started = Instant::now();
    let Some(world) = args.world_size else {
        return Err(Error::usage("--format deepspeed needs --world-size N")
            .hint("DeepSpeed's ZeRO partitions over data-parallel ranks only: no mesh"));
    };
    let select = &args.select;
    let unused = [
        (!args.replicate.is_empty(), "--replicate"),
        (!select.include.is_empty(), "--include"),
        (!select.exclude.is_empty(), "--exclude"),
        (!select.strip_prefix.is_empty(), "--strip-prefix"),
        (select.dtype.is_some(), "--dtype"),
        (args.lora.merge_lora.is_some(), "--merge-lora"),
        (args.write.part.is_some(), "--part"),
        (reading.shapes_from.is_some(), "--shapes-from"),
    ];
    if let Some((_, flag)) = unused.iter().find(|(given, _)| *given) {
        return Err(Error::usage(format!(
            "{flag} does not apply to `--format deepspeed`, which rewrites DeepSpeed's own files"
        ))
        .hint("reshard to DCP (`--format dcp`) to select, rename or cast tensors"));
    }
    let [input] = &args.path[..] else {
        return Err(Error::usage(
            "--format deepspeed reads one DeepSpeed checkpoint directory",
        ));
    };
    let done = crate::convert::reshard_deepspeed(
        input,
        reading.tag,
        world,
        &args.output,
        args.write.force,
    )?;
    if !args.write.quiet {
        let secs = started.elapsed().as_secs_f64();
        to_stderr(format_args!(
            "wrote ZeRO stage {} from {} to {world} data-parallel ranks at `{}`: {} files, {} in {:.2} s",
            done.stage,
            done.from_world,
            terminal_safe(&done.path.display().to_string()),
            done.files,
            human_bytes(done.bytes),
            secs
        ));
        let scripts = crate::formats::deepspeed::reshard::RECOVERY_SCRIPTS;
        let missing: Vec<&str> = scripts
            .iter()
            .copied()
            .filter(|s| !done.scripts.iter().any(|d| d == s))
            .collect();
        if !missing.is_empty() {
            to_stderr(format_args!(
                "note: the source has no {} beside its tags, so the output has none either \
                 (DeepSpeed's save writes both recovery scripts; they come with the deepspeed \
                 package, in deepspeed/utils/)",
                missing.join(" or ")
            ));
        }
    }
    Ok(0)
}

/// How every checkpoint a command reads is read: the global flags.
#[derive(Clone, Copy, Debug, Default)]
struct Reading<'a> {
    /// `--shapes-from`: names and shapes for an FSDP1 LOCAL checkpoint.
    shapes_from: Option<&'a Path>,
    /// `--tag`: which of a DeepSpeed directory's tags.
    tag: Option<&'a str>,
}

/// Read a checkpoint, an FSDP1 LOCAL one resolved with `--shapes-from`.
fn read(source: &Source, reading: Reading, open_items_when_copied: bool) -> Result<Checkpoint> {
    let opts = ReadOptions {
        open_items_when_copied,
        tag: reading.tag,
        ..ReadOptions::default()
    };
    crate::fsdp_local::apply(source.read(&opts)?, reading.shapes_from)
}

/// Write a small file (a manifest) under a temporary name, then rename it into place.
fn write_small_file(path: &Path, bytes: &[u8]) -> Result<()> {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("manifest");
    let tmp = path.with_file_name(format!(".{name}.ckpt-tmp-{}", std::process::id()));
    // `create_new` never follows a symlink planted under the temporary name.
    let _ = std::fs::remove_file(&tmp);
    let result = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .and_then(|mut f| {
            std::io::Write::write_all(&mut f, bytes)?;
            f.sync_all()
        })
        .and_then(|_| std::fs::rename(&tmp, path));
    result.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::io(path, e)
    })
}

impl From<Io> for IoMode {
    fn from(io: Io) -> IoMode {
        match io {
            Io::Mmap => IoMode::Mmap,
            Io::Read => IoMode::Read,
        }
    }
}

/// One conversion as the command line asked for it; the target comes separately because a
/// reshard's depends on the names left after selection.
struct Conversion<'a> {
    input: &'a Source,
    /// How the input is read (`--shapes-from`, `--tag`).
    reading: Reading<'a>,
    output: &'a Path,
    kind: OutputKind,
    /// `--merge-lora`, `--adapter`.
    lora: &'a LoraArgs,
    /// `--hf-config`.
    hf_config: Option<&'a Path>,
    /// `--quantize fp8-block`.
    fp8_block: bool,
    select: &'a SelectArgs,
    run: &'a RunArgs,
    write: &'a WriteArgs,
    cancel: &'a AtomicBool,
}

/// Run the library's [`crate::convert::convert`] for the command line's conversion, and tell
/// how it went on stderr.
fn convert(job: &Conversion, target_of: impl FnOnce(&Checkpoint) -> Target) -> Result<i32> {
    let started = Instant::now();
    let Conversion {
        select,
        write,
        run,
        cancel,
        ..
    } = *job;
    let cast = select.dtype.map(|d| match d {
        CastTo::Bf16 => DType::BF16,
        CastTo::Fp16 => DType::F16,
        CastTo::Fp32 => DType::F32,
    });
    let conversion = crate::convert::Conversion {
        input: job.input,
        shapes_from: job.reading.shapes_from,
        tag: job.reading.tag,
        output: job.output,
        kind: job.kind,
        lora: job
            .lora
            .merge_lora
            .as_deref()
            .map(|config| (config, job.lora.adapter.as_deref())),
        include: &select.include,
        exclude: &select.exclude,
        strip_prefix: &select.strip_prefix,
        cast,
        hf_config: job.hf_config,
        fp8_block: job.fp8_block,
        part: write.part,
        force: write.force,
        command_line: write
            .part
            .map(|p| command_line(p.count))
            .unwrap_or_default(),
    };
    let bar = Bar::new(!write.quiet && std::io::stderr().is_terminal());
    let opts = durable_options(run, &bar, cancel);
    let summary = crate::convert::convert(&conversion, &opts, target_of)?;
    if write.quiet {
        return Ok(0);
    }
    for note in &summary.notes {
        to_stderr(format_args!("note: {}", terminal_safe(note)));
    }
    let secs = started.elapsed().as_secs_f64();
    match summary.done {
        Done::Whole { path, files, bytes } => to_stderr(format_args!(
            "wrote {} tensors to `{}`: {} file{}, {} copied in {:.2} s ({}/s)",
            summary.tensors,
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
                    "all {} parts done: committed {} tensors to `{}`",
                    part.count,
                    summary.tensors,
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

/// How a conversion (whole or one part of it) runs: outputs made durable before they commit.
fn durable_options<'a>(run: &RunArgs, bar: &'a Bar, cancel: &'a AtomicBool) -> ExecOptions<'a> {
    ExecOptions {
        threads: run.threads,
        io: run.io.into(),
        progress: bar,
        cancel,
        durable: true,
    }
}

/// This process's command line with the `--part` value shown as `I/N`: the same command for
/// every part, for hints.
fn command_line(count: usize) -> String {
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
struct Bar(Option<indicatif::ProgressBar>);

impl Bar {
    fn new(show: bool) -> Bar {
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

/// `5GB`, `500MB`, `20KB` (decimal), `2GiB`, `512MiB`, `64KiB` (binary), or plain bytes.
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a size like 5GB or 512MiB"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        _ => {
            return Err(format!(
                "`{s}`: unknown unit (use KB, MB, GB, KiB, MiB, GiB)"
            ))
        }
    };
    let bytes = n * mult as f64;
    if bytes < 1.0 || !bytes.is_finite() {
        return Err(format!("`{s}` must be at least one byte"));
    }
    Ok(bytes as u64)
}

/// `4`, `2x4`, `2x2x2`.
pub fn parse_mesh(s: &str) -> Result<Vec<usize>> {
    s.split(['x', 'X', ','])
        .map(|d| {
            d.trim()
                .parse::<usize>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| Error::usage(format!("bad mesh `{s}`: expected sizes like 2x4")))
        })
        .collect()
}

/// `S(0),S(1)`, `R,S(0)`, `Shard(0),Replicate()`.
pub fn parse_placements(s: &str) -> Result<Vec<Placement>> {
    s.split(',')
        .map(|p| {
            let p = p.trim();
            let lower = p.to_ascii_lowercase();
            if lower == "r" || lower == "replicate" || lower == "replicate()" {
                return Ok(Placement::Replicate);
            }
            let inner = lower
                .strip_prefix("shard(")
                .or_else(|| lower.strip_prefix("s("))
                .and_then(|r| r.strip_suffix(')'));
            inner
                .and_then(|d| d.trim().parse::<usize>().ok())
                .map(Placement::Shard)
                .ok_or_else(|| Error::usage(format!("bad placement `{p}`: use S(d) or R")))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("5GB"), Ok(5_000_000_000));
        assert_eq!(parse_size("20KB"), Ok(20_000));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("1.5MB"), Ok(1_500_000));
        assert_eq!(parse_size("123"), Ok(123));
        assert!(parse_size("5 parsecs").is_err());
        assert!(parse_size("0").is_err());
    }

    #[test]
    fn meshes_and_placements_parse() {
        assert_eq!(parse_mesh("2x4").unwrap(), vec![2, 4]);
        assert!(parse_mesh("2x0").is_err());
        assert_eq!(
            parse_placements("S(0), R ,Shard(1)").unwrap(),
            vec![
                Placement::Shard(0),
                Placement::Replicate,
                Placement::Shard(1)
            ]
        );
        assert!(parse_placements("S(x)").is_err());
    }
}
