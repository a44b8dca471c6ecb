//! Which files a DeepSpeed checkpoint is: the tag `latest` (or `--tag`) names, and the model and
//! optimizer states in its directory, checked for what ckpt cannot read right (model or pipeline
//! parallel, experts) and for missing ranks before anything is opened.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::storage::{self, Entry, Stat};

/// The file naming the tag the last save wrote.
pub(crate) const LATEST: &str = "latest";
/// The file `ds_to_universal` writes beside the tags, naming the Universal Checkpoint it made.
pub(crate) const LATEST_UNIVERSAL: &str = "latest_universal";
/// A Universal Checkpoint's folder of per-parameter files, in its tag's directory.
pub(super) const UNIVERSAL_DIR: &str = "zero";
/// `latest` is a tag name: a few bytes.
const MAX_LATEST_BYTES: u64 = 4096;

/// Whether a file name is one of a tag's state files.
pub(super) fn is_states_file(name: &str) -> bool {
    name.ends_with("_model_states.pt") || name.ends_with("_optim_states.pt")
}

/// The tag read and its directory.
#[derive(Clone, Debug)]
pub(super) struct Tag {
    /// `global_step3`, or the directory's own name when it was given itself.
    pub name: String,
    pub dir: PathBuf,
    /// Weights exported beside the DeepSpeed state (a Hugging Face Trainer's `checkpoint-N/`
    /// holds `model.safetensors` too): their names, for `inspect` to point at.
    pub beside: Vec<String>,
}

impl Tag {
    /// The tag of the checkpoint at `path`: `tag` when given, else what `latest` names; `path`
    /// itself when it is a tag's directory.
    pub(super) fn find(path: &Path, tag: Option<&str>) -> Result<Tag> {
        let entries = storage::listing(path)?;
        let named = |n: &str| entries.iter().find(|e| e.name() == n);
        let own_name = || {
            path.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        };
        if let Some(tag) = tag {
            return match named(tag) {
                Some(e) if e.is_dir() => Ok(Tag {
                    name: tag.to_string(),
                    dir: e.path.clone(),
                    beside: exports(&entries),
                }),
                _ if own_name() == tag && entries.iter().any(|e| is_states_file(e.name())) => {
                    Ok(Tag {
                        name: tag.to_string(),
                        dir: path.to_path_buf(),
                        beside: Vec::new(),
                    })
                }
                _ => Err(Error::usage(format!("--tag {tag}: no such tag directory"))
                    .file(path)
                    .hint(tags_hint(&entries))),
            };
        }
        if entries
            .iter()
            .any(|e| e.is_file() && is_states_file(e.name()))
        {
            return Ok(Tag {
                name: own_name(),
                dir: path.to_path_buf(),
                beside: Vec::new(),
            });
        }
        // A save's own tag first; a Universal Checkpoint when it is all there is.
        let latest = named(LATEST)
            .filter(|e| e.is_file())
            .or_else(|| named(LATEST_UNIVERSAL).filter(|e| e.is_file()));
        let Some(latest) = latest else {
            return Err(Error::invalid("no `latest` file and no model states here")
                .file(path)
                .hint(tags_hint(&entries)));
        };
        if !matches!(latest.stat, Stat::File(len) if len <= MAX_LATEST_BYTES) {
            return Err(Error::invalid("`latest` is too large to name a tag").file(&latest.path));
        }
        let text = storage::read(&latest.path)?;
        let name = String::from_utf8_lossy(&text).trim().to_string();
        if name.is_empty() || name.contains(['/', '\\']) || name == ".." {
            return Err(
                Error::invalid(format!("`latest` names no usable tag: {name:?}"))
                    .file(&latest.path),
            );
        }
        match named(&name) {
            Some(e) if e.is_dir() => Ok(Tag {
                dir: e.path.clone(),
                name,
                beside: exports(&entries),
            }),
            _ => Err(Error::invalid(format!(
                "`{}` names the tag `{name}`, which is not here",
                latest.name()
            ))
            .file(&latest.path)
            .hint(tags_hint(&entries))),
        }
    }
}

/// The weights files a directory holds beside a DeepSpeed save.
fn exports(entries: &[Entry]) -> Vec<String> {
    entries
        .iter()
        .filter(|e| e.is_file())
        .map(|e| e.name())
        .filter(|n| {
            n.ends_with(".safetensors")
                || n.ends_with(".safetensors.index.json")
                || *n == "pytorch_model.bin"
        })
        .map(str::to_string)
        .collect()
}

/// The hint listing the tags a directory holds, for `--tag`.
fn tags_hint(entries: &[Entry]) -> String {
    let tags: Vec<&str> = entries
        .iter()
        .filter(|e| e.is_dir())
        .map(|e| e.name())
        .filter(|n| n.starts_with("global_step") || n.ends_with("_universal"))
        .collect();
    match tags.as_slice() {
        [] => {
            "point ckpt at the directory `engine.save_checkpoint` wrote, or at one tag's directory"
                .into()
        }
        _ => format!("pick a tag with --tag: {}", tags.join(", ")),
    }
}

/// A tag's state files, by rank.
#[derive(Clone, Debug)]
pub(super) struct Set {
    /// Model states: one (stages 0-2, `mp_rank_00_model_states.pt`) or one per rank (stage 3).
    pub model: Vec<PathBuf>,
    /// Optimizer states, rank 0 first; empty for a save without ZeRO.
    pub optim: Vec<PathBuf>,
}

impl Set {
    pub(super) fn list(dir: &Path) -> Result<Set> {
        let entries = storage::listing(dir)?;
        let mut single_model = None;
        let mut model = Vec::new();
        let mut optim = Vec::new();
        for e in entries.iter().filter(|e| e.is_file()) {
            let name = e.name();
            if let Some(reason) = refused(name) {
                return Err(Error::invalid(format!("{reason}: ckpt does not read it yet"))
                    .file(&e.path)
                    .hint("ckpt reads data-parallel ZeRO checkpoints (one model-parallel rank, no pipeline or expert files)"));
            }
            if name == "mp_rank_00_model_states.pt" {
                single_model = Some(e.path.clone());
            } else if let Some(r) = rank_of(name, "_mp_rank_00_model_states.pt") {
                model.push((r, e.path.clone()));
            } else if let Some(r) = rank_of(
                name.trim_start_matches("bf16_"),
                "_mp_rank_00_optim_states.pt",
            ) {
                optim.push((r, e.path.clone()));
            }
        }
        let model = match (single_model, model.is_empty()) {
            (Some(one), true) => vec![one],
            (None, false) => by_rank(model, dir, "zero_pp_rank_{r}_mp_rank_00_model_states.pt")?,
            (Some(_), false) => {
                return Err(Error::invalid(
                    "both `mp_rank_00_model_states.pt` and per-rank model states: two saves mixed",
                )
                .file(dir))
            }
            (None, true) => {
                return Err(
                    Error::invalid("no model states (`*_model_states.pt`) in this tag")
                        .file(dir)
                        .hint("the save did not finish, or this is not a DeepSpeed tag directory"),
                )
            }
        };
        let optim = by_rank(
            optim,
            dir,
            "[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
        )?;
        Ok(Set { model, optim })
    }
}

/// The rank of `zero_pp_rank_{r}{suffix}`.
fn rank_of(name: &str, suffix: &str) -> Option<usize> {
    let r = name.strip_prefix("zero_pp_rank_")?.strip_suffix(suffix)?;
    (!r.is_empty() && r.bytes().all(|b| b.is_ascii_digit()))
        .then(|| r.parse().ok())
        .flatten()
}

/// Files of ranks 0..N in rank order, or the error naming the first missing one.
fn by_rank(mut files: Vec<(usize, PathBuf)>, dir: &Path, pattern: &str) -> Result<Vec<PathBuf>> {
    files.sort();
    for (i, (r, path)) in files.iter().enumerate() {
        if *r != i {
            let which = if *r > i { "missing" } else { "there twice" };
            return Err(Error::invalid(format!(
                "rank {i}'s file ({pattern}) is {which}: the files go up to rank {}",
                files.last().map_or(0, |(r, _)| *r)
            ))
            .file(if *r > i { dir } else { path })
            .hint("every rank's file of one save is needed; copy the missing one or save again"));
        }
    }
    Ok(files.into_iter().map(|(_, p)| p).collect())
}

/// Why a file of a layout ckpt does not read is refused, naming the layout.
fn refused(name: &str) -> Option<&'static str> {
    if name.starts_with("layer_") && name.ends_with("-model_states.pt") {
        return Some("a pipeline-parallel stage's layer file");
    }
    if name.starts_with("expp_rank_") || name.contains("expert_") {
        return Some("a mixture-of-experts expert file");
    }
    let mp = name
        .split("mp_rank_")
        .nth(1)
        .and_then(|rest| rest.get(..2))
        .filter(|d| d.bytes().all(|b| b.is_ascii_digit()));
    match mp {
        Some(d) if d != "00" && is_states_file(name) => {
            Some("a model-parallel rank's file (tensor parallelism)")
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(
            rank_of(
                "zero_pp_rank_12_mp_rank_00_optim_states.pt",
                "_mp_rank_00_optim_states.pt"
            ),
            Some(12)
        );
        assert_eq!(
            rank_of(
                "zero_pp_rank__mp_rank_00_optim_states.pt",
                "_mp_rank_00_optim_states.pt"
            ),
            None
        );
        assert!(refused("mp_rank_01_model_states.pt").is_some());
        assert!(refused("zero_pp_rank_0_mp_rank_01_optim_states.pt").is_some());
        assert!(refused("layer_01-model_states.pt").is_some());
        assert!(refused("mp_rank_00_model_states.pt").is_none());
        assert!(refused("bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt").is_none());
    }

    #[test]
    fn a_missing_rank_is_named() {
        let files = vec![(0, PathBuf::from("a")), (2, PathBuf::from("c"))];
        let err = by_rank(files, Path::new("d"), "x_{r}").unwrap_err();
        assert!(err.message.contains("rank 1's file"), "{err}");
    }
}
