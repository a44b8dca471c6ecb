//! The library's error: what went wrong, where (file, tensor, byte offset), and what to do next.

use std::fmt;
use std::path::{Path, PathBuf};

/// What class of failure this is; the CLI maps it to an exit code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// Bad flags or a path that does not exist (exit 2).
    Usage,
    /// The checkpoint is malformed, unsupported or inconsistent (exit 1).
    Invalid,
    /// The operating system refused a read or write (exit 1).
    Io,
    /// A consistency check of ckpt's own work failed (a plan that contradicts itself, a value it
    /// built that cannot be serialized): a bug in ckpt whatever the input, reported as one so that
    /// nobody goes looking for a fault in their checkpoint (exit 1).
    Bug,
}

/// An error that names the file, tensor and byte offset it concerns, with an optional hint.
#[derive(Debug)]
pub struct Error {
    pub kind: ErrorKind,
    pub message: String,
    pub file: Option<PathBuf>,
    pub tensor: Option<String>,
    pub offset: Option<u64>,
    pub hint: Option<String>,
    pub source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Error {
        Error {
            kind,
            message: message.into(),
            file: None,
            tensor: None,
            offset: None,
            hint: None,
            source: None,
        }
    }

    /// A malformed or unsupported checkpoint.
    pub fn invalid(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Invalid, message)
    }

    /// A broken invariant of ckpt itself: the message says so and the hint asks for a report.
    pub fn bug(message: impl Into<String>) -> Error {
        Error::new(
            ErrorKind::Bug,
            format!("internal error, a bug in ckpt: {}", message.into()),
        )
        .hint(
            "the input is not at fault; please report this bug with the command line and \
             `ckpt --version`",
        )
    }

    pub fn usage(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Usage, message)
    }

    /// An I/O failure on `path`.
    pub fn io(path: &Path, err: std::io::Error) -> Error {
        let mut e = Error::new(ErrorKind::Io, err.to_string()).file(path);
        if err.kind() == std::io::ErrorKind::StorageFull {
            e.hint = Some("free space on that filesystem, or write the output elsewhere".into());
        }
        e.source = Some(Box::new(err));
        e
    }

    pub fn file(mut self, path: impl AsRef<Path>) -> Error {
        if self.file.is_none() {
            self.file = Some(path.as_ref().to_path_buf());
        }
        self
    }

    pub fn tensor(mut self, name: impl Into<String>) -> Error {
        if self.tensor.is_none() {
            self.tensor = Some(name.into());
        }
        self
    }

    pub fn at(mut self, offset: u64) -> Error {
        if self.offset.is_none() {
            self.offset = Some(offset);
        }
        self
    }

    /// Make an offset relative to an embedded item absolute: add `base` to it, or set `base` when
    /// the error had none.
    pub fn within(mut self, base: u64) -> Error {
        self.offset = Some(self.offset.map_or(base, |o| o.saturating_add(base)));
        self
    }

    pub fn hint(mut self, hint: impl Into<String>) -> Error {
        if self.hint.is_none() {
            self.hint = Some(hint.into());
        }
        self
    }

    /// The location prefix and message, without the hint: ``"`a.distcp`: tensor `w` at byte 12: ..."``.
    pub fn headline(&self) -> String {
        let mut where_ = Vec::new();
        if let Some(f) = &self.file {
            where_.push(format!("`{}`", f.display()));
        }
        if let Some(t) = &self.tensor {
            where_.push(format!("tensor `{t}`"));
        }
        if let Some(o) = self.offset {
            where_.push(format!("at byte {o}"));
        }
        if where_.is_empty() {
            self.message.clone()
        } else {
            format!("{}: {}", where_.join(", "), self.message)
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.headline())?;
        if let Some(h) = &self.hint {
            write!(f, "\nhint: {h}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

impl From<crate::pickle::PickleError> for Error {
    fn from(err: crate::pickle::PickleError) -> Error {
        Error::invalid(err.to_string())
    }
}

/// Shorthand for `Err(Error::invalid(format!(...)))`.
#[macro_export]
macro_rules! bail_invalid {
    ($($arg:tt)*) => { return Err($crate::error::Error::invalid(format!($($arg)*))) };
}
