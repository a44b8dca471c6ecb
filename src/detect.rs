//! Layout detection: which reader a path needs, and a helpful error when none fits.
//!
//! What ckpt was pointed at is listed once ([`Listing`]), then each layout of
//! [`crate::formats::LAYOUTS`] is asked in turn; the first that recognises it reads it. No layout
//! is named here: the registry's order and each layout's probe decide.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::formats::LAYOUTS;
use crate::layout::{Found, Layout, Listing, ReadOptions};
use crate::model::Checkpoint;
use crate::storage::{self, Entry, Stat};

/// What ckpt was pointed at: one file or directory, or several files of one per-rank save
/// (`ckpt inspect ckpt/model_world_size_4_rank_*.pt`).
#[derive(Clone, Debug)]
pub struct Source {
    paths: Vec<PathBuf>,
    /// The one path, or the directory that holds the files.
    root: PathBuf,
}

impl Source {
    pub fn new(paths: Vec<PathBuf>) -> Result<Source> {
        let root = match paths.as_slice() {
            [] => return Err(Error::usage("no checkpoint given")),
            [one] => one.clone(),
            many => match many[0].parent() {
                Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
                _ => PathBuf::from("."),
            },
        };
        Ok(Source { paths, root })
    }

    /// One path.
    pub fn one(path: &Path) -> Source {
        Source {
            paths: vec![path.to_path_buf()],
            root: path.to_path_buf(),
        }
    }

    /// The one path, or the directory of the files: what an output must not lie inside.
    pub fn path(&self) -> &Path {
        &self.root
    }

    /// The single path given, if only one was.
    pub fn single(&self) -> Option<&Path> {
        match self.paths.as_slice() {
            [one] => Some(one),
            _ => None,
        }
    }

    /// Read the checkpoint as its files hold it (an FSDP1 LOCAL one is resolved afterwards, see
    /// [`crate::transform::fsdp_local`]).
    pub fn read(&self, opts: &ReadOptions) -> Result<Checkpoint> {
        let listing = self.listing()?;
        let (layout, found) = detect(&listing)?;
        layout.read(&found, opts)
    }

    /// List what was given: one request for a directory, one per file given.
    pub fn listing(&self) -> Result<Listing> {
        match self.single() {
            Some(one) => Listing::of(one),
            None => {
                let mut files = Vec::with_capacity(self.paths.len());
                for p in &self.paths {
                    match storage::stat(p)? {
                        Some(stat @ Stat::File(_)) => files.push(Entry {
                            path: p.clone(),
                            stat,
                        }),
                        _ => {
                            return Err(Error::usage(format!(
                                "`{}` is not a file: several paths are the files of one per-rank checkpoint",
                                p.display()
                            )))
                        }
                    }
                }
                Ok(Listing::Files(files))
            }
        }
    }

    /// How messages name it: the path, or the first file and how many others.
    pub fn display(&self) -> String {
        match self.paths.as_slice() {
            [one] => one.display().to_string(),
            [first, rest @ ..] => format!("{} (and {} more files)", first.display(), rest.len()),
            [] => String::new(),
        }
    }
}

/// Read whatever checkpoint `path` is, with default options: a file (safetensors, torch.save,
/// an index) or a directory of any layout ckpt reads.
pub fn read(path: &Path) -> Result<Checkpoint> {
    Source::one(path).read(&ReadOptions::default())
}

/// The first layout of the registry that recognises `listing`, and what it found.
pub fn detect(listing: &Listing) -> Result<(&'static dyn Layout, Found)> {
    for &layout in LAYOUTS {
        if let Some(found) = layout.probe(listing)? {
            return Ok((layout, found));
        }
    }
    Err(match listing {
        Listing::Dir { path, entries } => no_layout(path, entries),
        Listing::File(f) => Error::invalid("not a checkpoint ckpt knows")
            .file(&f.path)
            .hint(format!("ckpt reads {}", every_layout())),
        Listing::Files(files) => {
            Error::invalid("these files are not the files of one per-rank checkpoint")
                .file(
                    files
                        .first()
                        .map(|f| f.path.as_path())
                        .unwrap_or(Path::new("")),
                )
                .hint("name the files by rank (`model_rank0.pt`, ...), or pass one checkpoint")
        }
    })
}

/// Every layout's description, for the hint when none recognises the input.
fn every_layout() -> String {
    let all: Vec<&str> = LAYOUTS.iter().map(|l| l.describe()).collect();
    match all.split_last() {
        Some((last, [])) => last.to_string(),
        Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
        None => String::new(),
    }
}

/// Subdirectories looked into for a checkpoint when a directory is none: enough for a training
/// run's output (`pytorch_model_fsdp_0/`, `optimizer_0/`, `checkpoint-100/`), few enough that a
/// directory of thousands costs no more than a few listings.
const SUBDIRS_LOOKED_INTO: usize = 16;

/// The error for a directory no layout recognises, pointing at a likely checkpoint inside it.
fn no_layout(dir: &Path, entries: &[Entry]) -> Error {
    let err = Error::invalid("no checkpoint layout recognised in this directory").file(dir);
    let mut nested: Vec<&Path> = entries
        .iter()
        .filter(|e| e.is_dir())
        .take(SUBDIRS_LOOKED_INTO)
        .filter(|e| {
            let inner = match storage::listing(&e.path) {
                Ok(entries) => Listing::Dir {
                    path: e.path.clone(),
                    entries,
                },
                Err(_) => return false,
            };
            LAYOUTS
                .iter()
                .any(|l| matches!(l.probe(&inner), Ok(Some(_))))
        })
        .map(|e| e.path.as_path())
        .collect();
    // accelerate saves `pytorch_model_fsdp_0/` beside `optimizer_0/`: the model is what most
    // people want, so it comes first.
    nested.sort_by_key(|p| {
        let name = p
            .file_name()
            .map(|n| n.to_string_lossy().to_lowercase())
            .unwrap_or_default();
        (!name.contains("model"), name.contains("optim"))
    });
    match nested.as_slice() {
        [] => {}
        [inner] => {
            return err.hint(format!(
                "it holds a checkpoint in `{}`: point ckpt at that",
                inner.display()
            ))
        }
        many => {
            let names: Vec<String> = many.iter().map(|p| format!("`{}`", p.display())).collect();
            return err.hint(format!(
                "it holds {} checkpoints, {}: point ckpt at one of them",
                many.len(),
                names.join(", ")
            ));
        }
    }
    let many = entries
        .iter()
        .filter(|e| e.is_file() && e.name().ends_with(".safetensors"))
        .count();
    if many > 1 {
        return err.hint(format!(
            "it holds {many} .safetensors files but no `{}`: pass one file, or restore the index",
            crate::formats::hf_index::INDEX_NAME
        ));
    }
    err.hint(format!("ckpt reads {}", every_layout()))
}
