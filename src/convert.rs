//! One conversion, as every command that writes runs it: **read → transform → plan → execute
//! → output**. Read the input (and resolve an FSDP1 LOCAL checkpoint with `--shapes-from`); the
//! steps between reading and planning (LoRA folding, selection, the export to Hugging Face names
//! and its FP8 quantization); the target layout resolved against what is left; the plan; the
//! write: staged under a temporary name and renamed, one `--part` share into the shared staging
//! area, or uploaded to an object store. The CLI turns its flags into a [`Conversion`] and prints
//! the [`Summary`]; the library never prints.

use std::path::{Path, PathBuf};

use crate::detect::Source;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::exec::{self, ExecOptions};
use crate::geometry::Placement;
use crate::layout::ReadOptions;
use crate::model::Checkpoint;
use crate::output::{Destination, Done, OutputKind, PartRun};
use crate::part::PartSpec;
use crate::plan::FileRole;
use crate::plan::{self, MeshSpec, PlanOptions, Target};
use crate::transform::fp8::dequant::Dequantize;
use crate::transform::fsdp_local::ResolveLocal;
use crate::transform::hf_export::{Export, HfConfig, Import, Trainer};
use crate::transform::lora::LoraOptions;
use crate::transform::select::Selection;
use crate::transform::{self, Report, Step};

/// How every checkpoint a command reads is read: the global flags.
#[derive(Clone, Debug, Default)]
pub(crate) struct Reading {
    /// `--shapes-from`: names and shapes for an FSDP1 LOCAL checkpoint.
    pub shapes_from: Option<PathBuf>,
    /// `--tag`: which of a directory's saved tags (DeepSpeed's, Megatron-LM's).
    pub tag: Option<String>,
}

/// Read the checkpoint at `input` as `reading` says, an FSDP1 LOCAL one resolved with
/// `--shapes-from`: the one way every command reads. `opts` says the rest (whether small items
/// in object storage wait until copied, where `verify` collects what it steps past).
pub(crate) fn read(input: &Source, reading: &Reading, opts: ReadOptions) -> Result<Checkpoint> {
    let opts = ReadOptions {
        tag: reading.tag.as_deref(),
        ..opts
    };
    let resolve = ResolveLocal {
        shapes_from: reading.shapes_from.as_deref(),
    };
    // What the step would report (nothing) is not asked for by any command.
    resolve.apply(input.read(&opts)?, &mut Report::default())
}

/// A FULL output's file format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FullFormat {
    Safetensors,
    Torch,
}

/// A SHARDED output's file format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ShardedFormat {
    Dcp,
    DcpSafetensors,
}

/// What a conversion writes.
#[derive(Clone, Debug)]
pub(crate) enum Layout {
    /// `consolidate`: one safetensors file, Hugging Face split files or a torch.save archive;
    /// the format, if not given, follows from the output's name.
    Full {
        format: Option<FullFormat>,
        max_shard_size: Option<u64>,
    },
    /// `reshard`: a DCP over a mesh, the tensors `replicate`'s globs match stored whole.
    Sharded {
        mesh: Vec<usize>,
        placements: Vec<Placement>,
        replicate: Vec<String>,
        format: ShardedFormat,
    },
    /// `reshard --format deepspeed`: DeepSpeed's own files at `world` data-parallel ranks.
    DeepSpeed { world: usize },
    /// `reshard --format megatron|torchtitan` of a Hugging Face release: the trainer's names
    /// and layouts, over `world` writers.
    Import { trainer: Trainer, world: usize },
}

/// Hugging Face's default shard size, as `save_pretrained` splits.
const HF_SHARD_BYTES: u64 = 5_000_000_000;

impl Layout {
    /// The target and output kind of a FULL output at `output`: a model directory with
    /// `--hf-config`; else by `--format`, `--max-shard-size` and the output's name.
    fn full_target(
        format: Option<FullFormat>,
        max_shard_size: Option<u64>,
        output: &Path,
        hf_export: bool,
    ) -> Result<(Target, OutputKind)> {
        let name = output
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_string();
        let torch_name = name.ends_with(".bin") || name.ends_with(".pt") || name.ends_with(".pth");
        Ok(match (format, max_shard_size) {
            // A model directory, split as `save_pretrained` splits it.
            _ if hf_export => (
                Target::SafetensorsSplit {
                    max_shard_bytes: max_shard_size.unwrap_or(HF_SHARD_BYTES),
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
            (None, None) if torch_name => (Target::TorchSave { file_name: name }, OutputKind::File),
            (_, None) => (
                Target::SafetensorsSplit {
                    max_shard_bytes: HF_SHARD_BYTES,
                },
                OutputKind::Dir,
            ),
        })
    }

    /// The sharded target for `ckpt` (as transformed: `--replicate` matches the names left
    /// after selection and renaming).
    fn sharded_target(
        mesh: &[usize],
        placements: &[Placement],
        replicate: &[String],
        format: ShardedFormat,
        ckpt: &Checkpoint,
    ) -> Result<Target> {
        let mut spec = MeshSpec {
            shape: mesh.to_vec(),
            placements: placements.to_vec(),
            replicated: Default::default(),
        };
        if !replicate.is_empty() {
            let names = Selection::new(replicate, &[], &[])?;
            spec.replicated = ckpt
                .tensors
                .iter()
                .filter(|t| names.keeps(&t.name))
                .map(|t| t.name.clone())
                .collect();
        }
        Ok(match format {
            ShardedFormat::Dcp => Target::Dcp(spec),
            ShardedFormat::DcpSafetensors => Target::DcpSafetensors(spec),
        })
    }
}

/// Everything one conversion needs.
#[derive(Clone, Debug)]
pub(crate) struct Conversion {
    pub input: Source,
    pub reading: Reading,
    pub output: PathBuf,
    pub layout: Layout,
    /// `--merge-lora CONFIG` and `--adapter NAME`.
    pub lora: Option<(PathBuf, Option<String>)>,
    /// `--include`, `--exclude`, `--strip-prefix`.
    pub include: Vec<String>,
    pub exclude: Vec<String>,
    pub strip_prefix: Vec<String>,
    /// `--dtype`.
    pub cast: Option<DType>,
    /// `--hf-config`: export to this Hugging Face model's names, beside its config and tokenizer.
    pub hf_config: Option<PathBuf>,
    /// `--quantize fp8-block`: the export's linear weights as blockwise FP8 (needs `hf_config`).
    pub fp8_block: bool,
    /// `--no-mtp`: the export leaves the model's multi-token prediction layers out.
    pub no_mtp: bool,
    /// `--part I/N`: one share of the output's bytes.
    pub part: Option<PartSpec>,
    /// Replace an existing output.
    pub force: bool,
    /// The command line with `--part` as `I/N`, for the hints of a partitioned run.
    pub command_line: String,
}

impl Conversion {
    /// The usage errors of the conversion's options, found before anything is read.
    pub(crate) fn check(&self) -> Result<()> {
        if self.fp8_block && self.hf_config.is_none() {
            return Err(crate::transform::fp8::needs_hf_config());
        }
        if self.no_mtp && self.hf_config.is_none() {
            return Err(Error::usage(
                "--no-mtp leaves out the multi-token prediction layers of a Hugging Face export",
            )
            .hint("pass --hf-config with the model's config.json"));
        }
        if let Layout::Sharded {
            mesh, placements, ..
        } = &self.layout
        {
            if mesh.len() != placements.len() || mesh.contains(&0) {
                return Err(Error::usage(format!(
                    "the mesh {mesh:?} needs one placement per dimension and no zero size, got {} placements",
                    placements.len()
                )));
            }
        }
        if let Layout::DeepSpeed { .. } = self.layout {
            let unused = [
                (!self.include.is_empty(), "--include"),
                (!self.exclude.is_empty(), "--exclude"),
                (!self.strip_prefix.is_empty(), "--strip-prefix"),
                (self.cast.is_some(), "--dtype"),
                (self.lora.is_some(), "--merge-lora"),
                (self.reading.shapes_from.is_some(), "--shapes-from"),
            ];
            if let Some((_, flag)) = unused.iter().find(|(given, _)| *given) {
                return Err(Error::usage(format!(
                    "{flag} does not apply to `--format deepspeed`, which rewrites DeepSpeed's own files"
                ))
                .hint("reshard to DCP (`--format dcp`) to select, rename or cast tensors"));
            }
            if self.input.single().is_none() {
                return Err(Error::usage(
                    "--format deepspeed reads one DeepSpeed checkpoint directory",
                ));
            }
        }
        Ok(())
    }
}

impl Conversion {
    /// Where the output goes, as `kind`; `description` is everything that changes its bytes,
    /// which the parts of a partitioned run must agree on.
    fn destination(&self, kind: OutputKind, description: String) -> Destination<'_> {
        Destination {
            path: &self.output,
            input: self.input.path(),
            kind,
            force: self.force,
            part: self.part.map(|spec| PartRun {
                spec,
                description,
                command_line: &self.command_line,
            }),
        }
    }

    /// The steps between reading and planning this conversion asks for, in order.
    fn steps(&self, io: exec::IoMode) -> Result<Vec<Box<dyn Step + '_>>> {
        let mut steps: Vec<Box<dyn Step + '_>> = Vec::new();
        if let Some((config, adapter)) = &self.lora {
            steps.push(Box::new(LoraOptions {
                config,
                adapter: adapter.as_deref(),
                io,
            }));
        }
        steps.push(Box::new(Selection::new(
            &self.include,
            &self.exclude,
            &self.strip_prefix,
        )?));
        if let Some(path) = &self.hf_config {
            let mut cfg = HfConfig::read(path)?;
            if self.no_mtp {
                cfg = cfg.without_mtp();
            }
            // A blockwise-FP8 release is read as its values, bf16 unless `--dtype` says.
            if let Some(block) = cfg.fp8_block {
                steps.push(Box::new(Dequantize {
                    block,
                    dtype: self.cast.unwrap_or(DType::BF16),
                    io,
                }));
            }
            steps.push(Box::new(Export {
                cfg,
                cast: self.cast,
                fp8_block: self.fp8_block,
                io,
            }));
        }
        Ok(steps)
    }
}

/// What a conversion did, for the caller to tell.
pub(crate) struct Summary {
    pub written: Written,
    /// Things the user should hear about (skipped entries, tensors `--dtype` left alone).
    pub notes: Vec<String>,
    pub done: Done,
}

/// What the output holds.
pub(crate) enum Written {
    /// Tensors (after selection).
    Tensors(usize),
    /// A DeepSpeed checkpoint rewritten at another world size, from ZeRO `stage` saved at
    /// `from_world` ranks.
    DeepSpeed { stage: i64, from_world: usize },
}

/// Read, transform, plan and write `job`'s output.
pub(crate) fn convert(job: &Conversion, exec_opts: &ExecOptions) -> Result<Summary> {
    job.check()?;
    match job.layout {
        Layout::DeepSpeed { world } => return convert_deepspeed(job, world, exec_opts),
        Layout::Import { trainer, world } => return convert_import(job, trainer, world, exec_opts),
        _ => {}
    }
    // Every item read is copied: small ones in object storage are opened when copied.
    let opts = ReadOptions {
        open_items_when_copied: true,
        ..ReadOptions::default()
    };
    let ckpt = read(&job.input, &job.reading, opts)?;
    let mut report = Report::default();
    let ckpt = transform::run(&job.steps(exec_opts.io)?, ckpt, &mut report)?;
    let (target, kind) = match &job.layout {
        Layout::Full {
            format,
            max_shard_size,
        } => Layout::full_target(
            *format,
            *max_shard_size,
            &job.output,
            job.hf_config.is_some(),
        )?,
        Layout::Sharded {
            mesh,
            placements,
            replicate,
            format,
        } => (
            Layout::sharded_target(mesh, placements, replicate, *format, &ckpt)?,
            OutputKind::Dir,
        ),
        Layout::DeepSpeed { .. } | Layout::Import { .. } => {
            return Err(Error::bug(
                "a DeepSpeed or import layout planned as a checkpoint's",
            ))
        }
    };
    let opts = PlanOptions { cast: job.cast };
    plan::check_dtypes(&ckpt, &target, &opts)?;
    let mut plan = plan::plan(&ckpt, &target, &opts)?;
    plan.notes.extend(uncast_note(&ckpt, job.cast));
    for (path, bytes) in report.files {
        plan.add_literal_file(path, bytes)?;
    }
    plan.notes.extend(report.notes);
    // Everything that changes the output's bytes, and nothing that does not (threads, --io,
    // --force, the part's own index): what the parts of a partitioned run must agree on.
    let description = format!(
        "ckpt {}\ntarget {target:?}\nkind {kind:?}\ninclude {:?}\nexclude {:?}\nstrip {:?}\ncast {:?}{}{}\nfp8-block {}\nno-mtp {}",
        env!("CARGO_PKG_VERSION"),
        job.include,
        job.exclude,
        job.strip_prefix,
        job.cast,
        crate::transform::fsdp_local::fingerprint("shapes-from", job.reading.shapes_from.as_deref())?,
        crate::transform::fsdp_local::fingerprint("hf-config", job.hf_config.as_deref())?,
        job.fp8_block,
        job.no_mtp
    );
    let description = match &job.lora {
        Some((config, adapter)) => format!(
            "{description}\nadapter {adapter:?}{}",
            crate::transform::fsdp_local::fingerprint(
                "merge-lora",
                Some(&crate::transform::lora::config_dir(config))
            )?
        ),
        None => description,
    };
    let done = crate::output::write(&plan, &job.destination(kind, description), exec_opts)?;
    Ok(Summary {
        written: Written::Tensors(ckpt.tensors.len()),
        notes: plan.notes,
        done,
    })
}

/// `reshard --format megatron|torchtitan`: the Hugging Face release at the input, under the
/// trainer's names and layouts ([`Import`]), as a DCP over `world` writers; for Megatron in a
/// save root as Megatron-LM's `save_checkpoint` leaves one (`latest_checkpointed_iteration.txt`
/// naming `release/`, which holds the DCP, `common.pt` and `metadata.json`).
fn convert_import(
    job: &Conversion,
    trainer: Trainer,
    world: usize,
    exec_opts: &ExecOptions,
) -> Result<Summary> {
    // The release's own config.json says what it is.
    let cfg = HfConfig::read(job.input.path()).map_err(|e| {
        e.hint("the import reads the release's config.json beside its weights: point ckpt at the model directory")
    })?;
    let opts = ReadOptions {
        open_items_when_copied: true,
        ..ReadOptions::default()
    };
    let ckpt = read(&job.input, &job.reading, opts)?;
    let mut report = Report::default();
    let select = Selection::new(&job.include, &job.exclude, &job.strip_prefix)?;
    let mut steps: Vec<Box<dyn Step>> = vec![Box::new(select)];
    // A blockwise-FP8 release is imported as its values, bf16 unless `--dtype` says.
    if let Some(block) = cfg.fp8_block {
        steps.push(Box::new(Dequantize {
            block,
            dtype: job.cast.unwrap_or(DType::BF16),
            io: exec_opts.io,
        }));
    }
    steps.push(Box::new(Import { cfg, trainer }));
    let ckpt = transform::run(&steps, ckpt, &mut report)?;
    let target = Target::Dcp(MeshSpec {
        shape: vec![world],
        placements: vec![Placement::Shard(0)],
        replicated: Default::default(),
    });
    let opts = PlanOptions { cast: job.cast };
    plan::check_dtypes(&ckpt, &target, &opts)?;
    let mut plan = plan::plan(&ckpt, &target, &opts)?;
    plan.notes.extend(uncast_note(&ckpt, job.cast));
    plan.notes.extend(report.notes);
    if let Trainer::Megatron { .. } = trainer {
        let release = PathBuf::from(MEGATRON_RELEASE);
        plan.nest(release.clone());
        let common = megatron_common()?;
        plan.add_file(release.join("common.pt"), common, FileRole::Data)?;
        plan.add_file(
            release.join("metadata.json"),
            MEGATRON_METADATA.as_bytes().to_vec(),
            FileRole::Data,
        )?;
        plan.add_file(
            PathBuf::from(MEGATRON_LATEST),
            MEGATRON_RELEASE.as_bytes().to_vec(),
            FileRole::CommitMarker,
        )?;
    }
    let description = format!(
        "ckpt {}\nimport {trainer:?} world {world}\ninclude {:?}\nexclude {:?}\nstrip {:?}\ncast {:?}",
        env!("CARGO_PKG_VERSION"),
        job.include,
        job.exclude,
        job.strip_prefix,
        job.cast,
    );
    let done = crate::output::write(
        &plan,
        &job.destination(OutputKind::Dir, description),
        exec_opts,
    )?;
    Ok(Summary {
        written: Written::Tensors(ckpt.tensors.len()),
        notes: plan.notes,
        done,
    })
}

/// Megatron-LM's save root: the file naming the iteration to load, and the directory of a
/// release (iteration 0, loaded with `--finetune` or as a new run's start).
const MEGATRON_LATEST: &str = "latest_checkpointed_iteration.txt";
const MEGATRON_RELEASE: &str = "release";
/// megatron-core's `metadata.json` of a `torch_dist` save, as `dist_checkpointing.save` writes it.
const MEGATRON_METADATA: &str = r#"{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}"#;

/// megatron-core's `common.pt` of an imported release: what Megatron-LM's `save_checkpoint`
/// puts beside the model's sharded state (`checkpoint_version` 3.0, `iteration` 0), no
/// arguments of a run.
fn megatron_common() -> Result<Vec<u8>> {
    use crate::pickle::Value;
    let common = Value::Dict(vec![
        (Value::Str("checkpoint_version".into()), Value::Float(3.0)),
        (Value::Str("iteration".into()), Value::Int(0)),
    ]);
    crate::formats::torch_save::save_value("common", &common)
}

/// `reshard --format deepspeed`: DeepSpeed's own files at `world` data-parallel ranks (ZeRO
/// stages 0-3; see [`crate::formats::deepspeed::reshard`]), planned from the input's files and
/// written like any plan.
fn convert_deepspeed(job: &Conversion, world: usize, exec_opts: &ExecOptions) -> Result<Summary> {
    let input = job.input.path();
    if !matches!(
        crate::storage::stat(input)?,
        Some(crate::storage::Stat::Dir)
    ) {
        return Err(Error::usage(
            "`--format deepspeed` rewrites a DeepSpeed checkpoint directory, and this is not a directory",
        )
        .file(input)
        .hint("point ckpt at the directory `engine.save_checkpoint` wrote, or at one tag's directory"));
    }
    let tag = job.reading.tag.as_deref();
    let resharded = crate::formats::deepspeed::reshard::plan(input, tag, world)?;
    // The recovery scripts DeepSpeed's save leaves beside the tags, which the source lacks.
    let missing: Vec<&str> = crate::formats::deepspeed::reshard::RECOVERY_SCRIPTS
        .iter()
        .copied()
        .filter(|name| !resharded.files.iter().any(|f| f.path == Path::new(name)))
        .collect();
    let mut notes = Vec::new();
    if !missing.is_empty() {
        notes.push(format!(
            "the source has no {} beside its tags, so the output has none either (DeepSpeed's \
             save writes both recovery scripts; they come with the deepspeed package, in \
             deepspeed/utils/)",
            missing.join(" or ")
        ));
    }
    let written = Written::DeepSpeed {
        stage: resharded.stage,
        from_world: resharded.from_world,
    };
    let description = format!(
        "ckpt {}\ndeepspeed world {world}\ntag {tag:?}",
        env!("CARGO_PKG_VERSION")
    );
    let plan = plan::deepspeed::plan(resharded)?;
    let done = crate::output::write(
        &plan,
        &job.destination(OutputKind::Dir, description),
        exec_opts,
    )?;
    Ok(Summary {
        written,
        notes,
        done,
    })
}

/// The note for tensors `--dtype` leaves as they are although they hold numbers of another kind
/// (complex, the fp8 scale and fnuz types, packed fp4): listed, so nobody expects them cast.
fn uncast_note(ckpt: &Checkpoint, cast: Option<DType>) -> Option<String> {
    cast?;
    let kept: Vec<String> = ckpt
        .tensors
        .iter()
        .filter(|t| t.dtype.is_kept_by_cast())
        .map(|t| format!("{} ({})", t.name, t.dtype))
        .collect();
    if kept.is_empty() {
        return None;
    }
    let shown = kept.len().min(8);
    let more = if kept.len() > shown {
        format!(" and {} more", kept.len() - shown)
    } else {
        String::new()
    };
    Some(format!(
        "--dtype left {} tensors as they are (complex, fp8 e8m0/fnuz and fp4 are not cast): {}{more}",
        kept.len(),
        kept[..shown].join(", ")
    ))
}
