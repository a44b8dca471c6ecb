//! ckpt: convert PyTorch checkpoints between FULL and SHARDED state-dict layouts without torch.
//!
//! The data flows one way: **read → plan → execute**. Readers ([`formats`], chosen by [`detect`])
//! turn any on-disk layout into one [`model::Checkpoint`]; the planner ([`plan`]) turns a checkpoint
//! and a target layout into a pure [`plan::Plan`] of destination files and copies; the executor
//! ([`exec`]) runs it into temporary names that [`output`] renames into place.

// Errors carry file, tensor, offset and hint for the user; they are built on the cold path only, so
// their size on the `Err` side of a `Result` costs nothing that matters.
#![allow(clippy::result_large_err)]
// Every declared dependency is used: a stale one fails the clippy gate. (Only the library build
// checks, since tests and the binary each use a subset.)
#![cfg_attr(not(test), warn(unused_crate_dependencies))]
// Items are crate-private unless the binary, tests, benches or fuzz targets use them: a `pub`
// that nothing outside can reach is flagged.
#![warn(unreachable_pub)]

// ckpt copies with copy_file_range(2), flushes with sync_file_range(2), checks processes and the
// host name in /proc and opens files with O_NOFOLLOW: said once here, at build time, rather than
// as a wall of unresolved names from libc.
#[cfg(not(target_os = "linux"))]
compile_error!(
    "ckpt supports Linux only: it copies with copy_file_range(2), flushes with sync_file_range(2) \
     and reads /proc; build it on Linux, in WSL 2 on Windows or in a Linux container on macOS"
);

pub mod cast;
pub mod cli;
pub(crate) mod commands;
pub(crate) mod convert;
pub mod detect;
pub mod dtype;
pub mod error;
pub mod exec;
pub mod formats;
pub mod geometry;
pub(crate) mod inspect;
pub mod interrupt;
pub(crate) mod layout;
pub mod model;
pub mod output;
pub mod part;
pub mod pickle;
pub mod plan;
pub(crate) mod storage;
pub(crate) mod transform;
pub mod verify;
pub mod zip;

pub use error::{Error, ErrorKind, Result};
