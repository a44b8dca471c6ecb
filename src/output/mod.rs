//! Where a plan's bytes end up, and how an output becomes visible only once it is complete.
//!
//! Three backends, one promise (nothing is a checkpoint before all of it is written):
//! [`local`] stages a local output under a temporary name and renames it into place; [`part`]
//! shares one staged output between the `--part I/N` runs of a partitioned job, the last to
//! finish committing it; [`remote`] uploads into an object store with multipart uploads, the
//! plan's commit markers completed last; [`remote_part`] shares those uploads between the parts
//! of a partitioned run, the last to finish completing them. The plan says which file is which
//! ([`crate::plan::FileRole`]); no backend knows a format's file names.

pub mod local;
pub mod part;
pub mod remote;
pub mod remote_part;

pub use local::{leftovers, Staging};

/// The unfinished partitioned run that `path` names, on a filesystem or in an object store: what
/// `verify` tells of a path that is a run's staging area or an output its parts have not finished.
pub fn unfinished(path: &std::path::Path) -> Option<part::Unfinished> {
    if crate::storage::is_remote(path) {
        return remote_part::unfinished(path);
    }
    part::unfinished(path)
}

/// Whether the output is one file or a directory of files.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputKind {
    File,
    Dir,
}
