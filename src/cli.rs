//! Command-line interface: the flags (clap derive), parsed in full and turned into the plain
//! options of [`crate::commands`], which run them. clap types stay in this module, and nothing
//! here reads a checkpoint or prints a result.

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;

use clap::{CommandFactory, Parser, Subcommand, ValueEnum};

use crate::commands::{self, Run};
use crate::convert::{self, Conversion, Layout, Reading};
use crate::detect::Source;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::exec::IoMode;
use crate::geometry::Placement;
use crate::part::PartSpec;
use crate::transform::hf_export::{LayerSpec, Trainer};

pub use crate::commands::{terminal_safe, to_stderr};

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
    /// Leave out the model's multi-token prediction layers (DeepSeek-V3's, GLM-4.5's): the
    /// export's config.json then says `num_nextn_predict_layers` 0. Needs --hf-config.
    #[arg(long)]
    no_mtp: bool,
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
    /// With `--format megatron`: the tensor-parallel size the run will use, for Megatron-LM's
    /// vocabulary padding (to a multiple of `--make-vocab-size-divisible-by` × this).
    #[arg(long, value_name = "T", default_value_t = 1)]
    tensor_parallel_size: u64,
    /// With `--format megatron`: Megatron-LM's `--make-vocab-size-divisible-by`.
    #[arg(long, value_name = "M", default_value_t = 128)]
    make_vocab_size_divisible_by: u64,
    /// With `--format megatron`: Megatron-LM's `--transformer-impl` of the run, whose layer spec
    /// decides the names of the norms (fused into the next linear, or modules of their own).
    #[arg(
        long,
        value_enum,
        value_name = "IMPL",
        default_value = "transformer_engine"
    )]
    transformer_impl: TransformerImplArg,
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

/// Megatron-LM's `--transformer-impl` values, spelt as it spells them.
#[derive(Clone, Copy, Debug, ValueEnum)]
#[value(rename_all = "snake_case")]
enum TransformerImplArg {
    /// Transformer Engine's layer spec (Megatron-LM's default).
    TransformerEngine,
    /// megatron-core's local layer spec.
    Local,
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
    /// A Hugging Face release (input: its model directory) as a Megatron-core `torch_dist`
    /// save root that Megatron-LM starts a run from (`--load OUT --finetune`).
    Megatron,
    /// A Hugging Face release (input: its model directory) as a torchtitan DCP, the initial
    /// checkpoint of a torchtitan run.
    Torchtitan,
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

/// Exit codes: 0 success, 1 problems found or failure, 2 usage error; the binary exits 130
/// (SIGINT) or 143 (SIGTERM) when interrupted (see [`crate::interrupt`]).
pub fn run(cli: Cli, cancel: &AtomicBool) -> Result<i32> {
    let reading = Reading {
        shapes_from: cli.shapes_from,
        tag: cli.tag,
    };
    match cli.command {
        Command::Inspect(args) => commands::inspect::run(commands::inspect::Inspect {
            input: Source::new(args.path)?,
            reading,
            json: args.json,
            filters: args.filters,
            lora_config: args.lora_config,
            hf_config: args.hf_config,
        }),
        Command::Verify(args) => commands::verify::run(commands::verify::Verify {
            input: Source::new(args.path)?,
            reading,
            json: args.json,
            deep: args.deep,
            against: args.against,
            write_manifest: args.write_manifest,
            manifest: args.manifest,
            run: args.run.into(),
        }),
        Command::Consolidate(args) => {
            let layout = Layout::Full {
                format: args.format.map(|f| match f {
                    FullFormat::Safetensors => convert::FullFormat::Safetensors,
                    FullFormat::Torch => convert::FullFormat::Torch,
                }),
                max_shard_size: args.max_shard_size,
            };
            let fp8_block = args.quantize == Some(Quantize::Fp8Block);
            let (run, quiet) = (args.run.into(), args.write.quiet);
            let job = conversion(
                args.path,
                args.output,
                layout,
                reading,
                args.lora,
                args.select,
                args.write,
            )?;
            let job = Conversion {
                hf_config: args.hf_config,
                fp8_block,
                no_mtp: args.no_mtp,
                ..job
            };
            commands::convert::run(&job, run, quiet, cancel)
        }
        Command::Reshard(args) => {
            let layout = sharded_layout(&args)?;
            let (run, quiet) = (args.run.into(), args.write.quiet);
            let job = conversion(
                args.path,
                args.output,
                layout,
                reading,
                args.lora,
                args.select,
                args.write,
            )?;
            commands::convert::run(&job, run, quiet, cancel)
        }
        Command::GenerateShellCompletion(args) => completion(args),
    }
}

/// `ckpt generate-shell-completion SHELL`: the script clap_complete derives from these flags.
fn completion(args: CompletionArgs) -> Result<i32> {
    // Generated into memory first: clap_complete panics on a failed write, and a closed stdout
    // must end quietly like every other command's.
    let mut script = Vec::new();
    clap_complete::generate(args.shell, &mut Cli::command(), "ckpt", &mut script);
    commands::to_stdout(|out| out.write_all(&script))?;
    Ok(0)
}

/// The conversion the flags every writing command shares ask for.
fn conversion(
    path: Vec<PathBuf>,
    output: PathBuf,
    layout: Layout,
    reading: Reading,
    lora: LoraArgs,
    select: SelectArgs,
    write: WriteArgs,
) -> Result<Conversion> {
    Ok(Conversion {
        input: Source::new(path)?,
        reading,
        output,
        layout,
        lora: lora.merge_lora.map(|config| (config, lora.adapter)),
        include: select.include,
        exclude: select.exclude,
        strip_prefix: select.strip_prefix,
        cast: select.dtype.map(|d| match d {
            CastTo::Bf16 => DType::BF16,
            CastTo::Fp16 => DType::F16,
            CastTo::Fp32 => DType::F32,
        }),
        hf_config: None,
        fp8_block: false,
        no_mtp: false,
        part: write.part,
        force: write.force,
        command_line: write
            .part
            .map(|p| commands::command_line(p.count))
            .unwrap_or_default(),
    })
}

/// `reshard`'s target: DeepSpeed's own files at `--world-size` ranks, or a DCP over a mesh.
fn sharded_layout(args: &ReshardArgs) -> Result<Layout> {
    if let ShardedFormat::Megatron | ShardedFormat::Torchtitan = args.format {
        if args.mesh.is_some() || !args.replicate.is_empty() {
            return Err(Error::usage(
                "an import writes over --world-size writers: --mesh and --replicate do not apply",
            )
            .hint("the trainer reshards on load: any world size serves"));
        }
        if args.lora.merge_lora.is_some() {
            return Err(Error::usage(
                "an import writes a Hugging Face release as it is: --merge-lora does not apply",
            )
            .hint("fold the adapter into the release first (`ckpt consolidate` with --merge-lora), then import that"));
        }
        let trainer = match args.format {
            ShardedFormat::Megatron => Trainer::Megatron {
                tensor_parallel: args.tensor_parallel_size,
                vocab_multiple: args.make_vocab_size_divisible_by,
                spec: match args.transformer_impl {
                    TransformerImplArg::TransformerEngine => LayerSpec::TransformerEngine,
                    TransformerImplArg::Local => LayerSpec::Local,
                },
            },
            _ => Trainer::Torchtitan,
        };
        return Ok(Layout::Import {
            trainer,
            world: args.world_size.unwrap_or(1),
        });
    }
    if let ShardedFormat::Deepspeed = args.format {
        let Some(world) = args.world_size else {
            return Err(Error::usage("--format deepspeed needs --world-size N")
                .hint("DeepSpeed's ZeRO partitions over data-parallel ranks only: no mesh"));
        };
        if !args.replicate.is_empty() {
            return Err(Error::usage(
                "--replicate does not apply to `--format deepspeed`, which rewrites DeepSpeed's own files",
            )
            .hint("reshard to DCP (`--format dcp`) to select, rename or cast tensors"));
        }
        return Ok(Layout::DeepSpeed { world });
    }
    let (mesh, placements) = match (args.world_size, &args.mesh) {
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
    Ok(Layout::Sharded {
        mesh,
        placements,
        replicate: args.replicate.clone(),
        format: match args.format {
            ShardedFormat::DcpSafetensors => convert::ShardedFormat::DcpSafetensors,
            _ => convert::ShardedFormat::Dcp,
        },
    })
}

impl From<RunArgs> for Run {
    fn from(run: RunArgs) -> Run {
        Run {
            threads: run.threads,
            io: match run.io {
                Io::Mmap => IoMode::Mmap,
                Io::Read => IoMode::Read,
            },
        }
    }
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
