//! Local output: nothing appears under the final name until it is complete.
//!
//! Files are written under a temporary name beside the destination (`.NAME.ckpt-tmp-PID`), synced,
//! then renamed into place. A run that dies leaves only such a temporary, which the next run into
//! the same destination removes once the process that made it is gone. Missing directories above
//! the output are created, and removed again if the run fails. ckpt refuses to overwrite
//! without `--force`, and refuses outright any output that is, contains or sits inside an input.

use std::path::{Path, PathBuf};

use super::OutputKind;
use crate::error::{Error, Result};

const TMP_MARK: &str = ".ckpt-tmp-";
const OLD_MARK: &str = ".ckpt-old-";

/// A destination being written.
#[derive(Debug)]
pub struct Staging {
    final_path: PathBuf,
    temp_path: PathBuf,
    kind: OutputKind,
    force: bool,
    committed: bool,
    /// Directories this run created for the output, outermost first: removed again (when
    /// empty) if the run does not commit.
    created: Vec<PathBuf>,
    /// A signal stops the run, so that dropping this removes the temporary, instead of ending
    /// the process (dropped after [`Staging`]'s own `drop`, as fields are).
    _armed: crate::interrupt::Armed,
}

impl Staging {
    /// Check `out` against the input and existing files, clean stale temporaries, and pick the
    /// temporary name.
    pub fn prepare(out: &Path, input: &Path, kind: OutputKind, force: bool) -> Result<Staging> {
        let (parent, name, final_path, missing) = resolve(out, input, force)?;
        let name = name.as_str();
        let temp_path = parent.join(format!(".{name}{TMP_MARK}{}", std::process::id()));
        // From here on, dropping the staging undoes what was made.
        let mut staging = Staging {
            final_path,
            temp_path,
            kind,
            force,
            committed: false,
            created: Vec::new(),
            _armed: crate::interrupt::Armed::new(),
        };
        for dir in missing {
            match std::fs::create_dir(&dir) {
                Ok(()) => staging.created.push(dir),
                // Made meanwhile by someone else: theirs, so not removed on failure.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && dir.is_dir() => {}
                Err(e) => return Err(Error::io(&dir, e)),
            }
        }
        remove_stale(&parent, name);
        if kind == OutputKind::Dir {
            std::fs::create_dir(&staging.temp_path)
                .map_err(|e| Error::io(&staging.temp_path, e))?;
        }
        Ok(staging)
    }

    /// Where each planned file is written: the temporary file itself, or files inside the
    /// temporary directory.
    pub fn paths(&self, relative: &[PathBuf]) -> Vec<PathBuf> {
        match self.kind {
            OutputKind::File => relative.iter().map(|_| self.temp_path.clone()).collect(),
            OutputKind::Dir => relative.iter().map(|p| self.temp_path.join(p)).collect(),
        }
    }

    pub fn final_path(&self) -> &Path {
        &self.final_path
    }

    /// Move the finished output into place (replacing an old one under `--force`).
    pub fn commit(mut self) -> Result<()> {
        if self.kind == OutputKind::Dir {
            sync_dir(&self.temp_path)?;
        }
        move_into_place(&self.temp_path, &self.final_path, self.force, || {
            self.committed = true
        })
    }
}

/// Check `out` against the input and an existing output: its directory (absolute, through its
/// deepest existing ancestor), its name, its final path, and the directories to create for it
/// (outermost first; see [`resolve_dir`]).
pub(crate) fn resolve(
    out: &Path,
    input: &Path,
    force: bool,
) -> Result<(PathBuf, String, PathBuf, Vec<PathBuf>)> {
    let name = out
        .file_name()
        .and_then(|n| n.to_str())
        .filter(|n| !n.is_empty() && *n != "." && *n != "..")
        .ok_or_else(|| Error::usage(format!("`{}` is not a usable output name", out.display())))?;
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let (parent, missing) = resolve_dir(&parent)?;
    let final_path = parent.join(name);
    // A remote input cannot be, contain or lie inside a local output.
    if !crate::storage::is_remote(input) {
        let input = input.canonicalize().map_err(|e| Error::io(input, e))?;
        if final_path == input || final_path.starts_with(&input) || input.starts_with(&final_path) {
            return Err(Error::usage(format!(
                "the output `{}` is, contains or lies inside the input `{}`",
                out.display(),
                input.display()
            ))
            .hint("write the output somewhere else: ckpt never modifies its input"));
        }
    }
    if final_path.symlink_metadata().is_ok() && !force {
        return Err(Error::usage(format!("`{}` already exists", out.display()))
            .hint("pass --force to replace it"));
    }
    Ok((parent, name.to_string(), final_path, missing))
}

/// Rename `temp` to `final_path`, first moving an existing output aside when `force` (and
/// removing it after). `renamed` runs right after the rename that makes the output visible.
pub(crate) fn move_into_place(
    temp: &Path,
    final_path: &Path,
    force: bool,
    renamed: impl FnOnce(),
) -> Result<()> {
    let parent = final_path.parent().unwrap_or(Path::new(".")).to_path_buf();
    let mut old = None;
    if force && final_path.symlink_metadata().is_ok() {
        let name = final_path.file_name().unwrap_or_default().to_string_lossy();
        let aside = parent.join(format!(".{name}{OLD_MARK}{}", std::process::id()));
        std::fs::rename(final_path, &aside).map_err(|e| Error::io(final_path, e))?;
        old = Some(aside);
    }
    std::fs::rename(temp, final_path).map_err(|e| Error::io(final_path, e))?;
    renamed();
    sync_dir(&parent)?;
    if let Some(old) = old {
        remove_path(&old);
    }
    Ok(())
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.committed {
            remove_path(&self.temp_path);
            for dir in self.created.iter().rev() {
                // Only if empty: anything another process put there stays.
                let _ = std::fs::remove_dir(dir);
            }
        }
    }
}

/// `dir` made absolute through its deepest existing ancestor (symlinks resolved there), and the
/// directories below that ancestor which do not exist yet, outermost first.
fn resolve_dir(dir: &Path) -> Result<(PathBuf, Vec<PathBuf>)> {
    let mut tail = Vec::new();
    let mut existing = dir;
    while existing.symlink_metadata().is_err() {
        match (existing.parent(), existing.components().next_back()) {
            (Some(up), Some(std::path::Component::Normal(name))) => {
                tail.push(name);
                existing = if up.as_os_str().is_empty() {
                    Path::new(".")
                } else {
                    up
                };
            }
            // `..` or `.` below a missing directory: what it means depends on that directory.
            _ => {
                return Err(Error::usage(format!(
                    "the output's directory `{}` does not exist",
                    dir.display()
                )))
            }
        }
    }
    let mut path = existing
        .canonicalize()
        .map_err(|e| Error::io(existing, e))?;
    if !path.is_dir() {
        return Err(Error::usage(format!(
            "`{}` is not a directory, so the output cannot go inside it",
            existing.display()
        )));
    }
    let mut missing = Vec::with_capacity(tail.len());
    for name in tail.into_iter().rev() {
        path.push(name);
        missing.push(path.clone());
    }
    Ok((path, missing))
}

pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io(dir, e))
}

pub(crate) fn remove_path(path: &Path) {
    let _ = if path.is_dir() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    };
}

/// Remove `.NAME.ckpt-tmp-PID` and `.NAME.ckpt-old-PID` left by runs whose process is gone.
fn remove_stale(parent: &Path, name: &str) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let Some(file_name) = file_name.to_str() else {
            continue;
        };
        let Some(rest) = file_name
            .strip_prefix('.')
            .and_then(|r| r.strip_prefix(name))
        else {
            continue;
        };
        let pid = rest
            .strip_prefix(TMP_MARK)
            .or_else(|| rest.strip_prefix(OLD_MARK));
        if let Some(pid) = pid.and_then(|p| p.parse::<u32>().ok()) {
            if !Path::new(&format!("/proc/{pid}")).exists() {
                remove_path(&entry.path());
            }
        }
    }
}

/// Names of leftover temporaries beside `out` (for tests and messages).
pub fn leftovers(out: &Path) -> Vec<PathBuf> {
    let parent = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = out.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    let prefix = format!(".{name}{TMP_MARK}");
    std::fs::read_dir(parent)
        .map(|list| {
            list.flatten()
                .filter(|e| {
                    e.file_name()
                        .to_str()
                        .is_some_and(|n| n.starts_with(&prefix))
                })
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default()
}
