//! The reader seam: what every on-disk layout ckpt reads has to offer.
//!
//! A layout is a value implementing [`Layout`], listed once in [`crate::formats::LAYOUTS`].
//! Detection ([`crate::detect`]) lists what ckpt was pointed at once ([`Listing`]) and asks each
//! layout in turn to [`Layout::probe`] it; the first that recognises it reads it
//! ([`Layout::read`]), with every setting that changes what a reader returns passed in
//! [`ReadOptions`]. When none does, the "ckpt reads ..." hint is made from every layout's
//! [`Layout::describe`], so it cannot forget one.
//!
//! Adding a layout is one file under `formats/` implementing this trait and one entry in the
//! registry: nothing here or in detection changes.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::error::{Error, Result};
use crate::model::Checkpoint;
use crate::storage::{self, Entry, Stat};

/// One on-disk layout: how to recognise it and how to read it.
pub trait Layout: Sync {
    /// What it is, for messages: `DCP directories (\`.metadata\`)`.
    fn describe(&self) -> &'static str;

    /// Whether `at` is this layout, from the one listing detection made (names, kinds and sizes,
    /// no further request for most layouts). A probe that has to read a file to tell (Megatron's
    /// `metadata.json`) may; an I/O error is an error, never "not this layout".
    fn probe(&self, at: &Listing) -> Result<Option<Found>>;

    /// Read what the probe found.
    fn read(&self, found: &Found, opts: &ReadOptions) -> Result<Checkpoint>;
}

/// What ckpt was pointed at, listed once.
#[derive(Clone, Debug)]
pub enum Listing {
    /// A directory and its entries.
    Dir { path: PathBuf, entries: Vec<Entry> },
    /// One file.
    File(Entry),
    /// Several files given together (the files of one per-rank save).
    Files(Vec<Entry>),
}

impl Listing {
    /// What is at `path`, listed once: a directory's entries, or the file itself.
    pub fn of(path: &Path) -> Result<Listing> {
        Ok(match storage::look(path)? {
            storage::Look::Dir(entries) => Listing::Dir {
                path: path.to_path_buf(),
                entries,
            },
            storage::Look::File(len) => Listing::File(Entry {
                path: path.to_path_buf(),
                stat: Stat::File(len),
            }),
        })
    }

    /// The directory's entry named `name`, if it is a file.
    pub fn file_named(&self, name: &str) -> Option<&Entry> {
        match self {
            Listing::Dir { entries, .. } => {
                entries.iter().find(|e| e.is_file() && e.name() == name)
            }
            _ => None,
        }
    }

    /// The files of a directory, or the files given.
    pub fn files(&self) -> Vec<&Entry> {
        match self {
            Listing::Dir { entries, .. } => entries.iter().filter(|e| e.is_file()).collect(),
            Listing::File(one) => vec![one],
            Listing::Files(many) => many.iter().collect(),
        }
    }

    /// The directory listed, if a directory was.
    pub fn dir(&self) -> Option<&Path> {
        match self {
            Listing::Dir { path, .. } => Some(path),
            _ => None,
        }
    }

    /// The one file given, if one file was.
    pub fn file(&self) -> Option<&Entry> {
        match self {
            Listing::File(one) => Some(one),
            _ => None,
        }
    }
}

/// What a probe recognised, for its own [`Layout::read`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Found {
    /// What the reader opens: the checkpoint's directory, or its one file.
    pub path: PathBuf,
    /// The files the probe picked out, where the layout is a set of them (per-rank files).
    pub files: Vec<PathBuf>,
}

impl Found {
    pub fn at(path: impl Into<PathBuf>) -> Found {
        Found {
            path: path.into(),
            files: Vec::new(),
        }
    }
}

/// Everything that changes what a reader returns, passed explicitly (never set aside for a
/// thread to find, which a rayon worker would not).
#[derive(Clone, Copy, Debug, Default)]
pub struct ReadOptions<'a> {
    /// Leave small DCP items in object storage unopened ([`crate::model::Encoding::Saved`]), to be
    /// fetched once, framing and data together, when copied: for commands that copy every item
    /// they read (consolidate, reshard). `inspect` and `verify` open every item as they read.
    pub open_items_when_copied: bool,
    /// Where problems a reader can step past (one broken item, one unreadable file among
    /// several) go, so `verify` lists them all; without it the first is the read's error.
    pub problems: Option<&'a Problems>,
    /// Which saved tag to read where a checkpoint directory holds several (DeepSpeed's
    /// `global_stepN`; without it, the one `latest` names).
    pub tag: Option<&'a str>,
}

impl ReadOptions<'_> {
    /// A problem the reader can step past: kept in [`ReadOptions::problems`] when there is a
    /// collector, else returned as the error it is. The reader then leaves out what it concerns.
    pub fn step_past(&self, err: Error) -> Result<()> {
        match self.problems {
            Some(problems) => {
                problems.push(err);
                Ok(())
            }
            None => Err(err),
        }
    }
}

/// At most this many problems are listed one by one; past it they are only counted.
const MAX_LISTED: usize = 1000;

/// The problems readers stepped past, in the order they were found (readers may find them on
/// several threads).
#[derive(Debug, Default)]
pub struct Problems {
    /// (listed, counted past [`MAX_LISTED`]).
    found: Mutex<(Vec<Error>, usize)>,
}

impl Problems {
    pub fn push(&self, err: Error) {
        let mut found = self.found.lock().unwrap_or_else(|p| p.into_inner());
        if found.0.len() < MAX_LISTED {
            found.0.push(err);
        } else {
            found.1 += 1;
        }
    }

    /// Every problem, those past the first thousand counted in one last error.
    pub fn into_errors(self) -> Vec<Error> {
        let (mut listed, more) = self.found.into_inner().unwrap_or_else(|p| p.into_inner());
        if more > 0 {
            listed.push(Error::invalid(format!(
                "and {more} more problems like these, not listed"
            )));
        }
        listed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problems_past_the_first_thousand_are_counted() {
        let problems = Problems::default();
        let opts = ReadOptions {
            problems: Some(&problems),
            ..ReadOptions::default()
        };
        for i in 0..1003 {
            opts.step_past(Error::invalid(format!("broken {i}")))
                .unwrap();
        }
        let errors = problems.into_errors();
        assert_eq!(errors.len(), 1001);
        assert_eq!(errors[999].message, "broken 999");
        assert!(errors[1000].message.contains("3 more problems"));
    }

    #[test]
    fn without_a_collector_the_first_problem_is_the_error() {
        let err = ReadOptions::default()
            .step_past(Error::invalid("broken"))
            .unwrap_err();
        assert_eq!(err.message, "broken");
    }
}
