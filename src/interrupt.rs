//! Ctrl-C (SIGINT) and SIGTERM: what an interrupted run leaves behind, and how soon it ends.
//!
//! A run that holds something an exit would leave behind (a staged output, open multipart uploads,
//! a part's hold on a shared staging area) holds an [`Armed`] guard while it does. The first
//! signal sets the cancel flag the executor, the `.metadata` writer and the uploader poll; they
//! stop, the guards' owners undo what they made, and the command exits with 128 + the signal's
//! number. A signal that finds no guard held (reading, planning, `inspect`, `verify`) ends the
//! process at once: there is nothing to undo, and reading a `.metadata` of millions of pieces
//! polls nothing. A second signal always ends the process at once; what the first run staged is
//! then removed by the next run into the same place.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};

/// Set by the first signal; what the library's `cancel` arguments point at in the binary.
static CANCEL: AtomicBool = AtomicBool::new(false);
/// The first signal's number, 0 before one arrives.
static SIGNAL: AtomicI32 = AtomicI32::new(0);
/// Guards held: things an exit now would leave behind.
static ARMED: AtomicUsize = AtomicUsize::new(0);

/// Install the handler for SIGINT and SIGTERM; returns the flag it sets.
pub fn install() -> &'static AtomicBool {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: an all-zero `sigaction` is a valid empty one (no flags, empty mask) that is
        // filled in below; `on_signal` is an `extern "C" fn(c_int)` that does only
        // async-signal-safe things (atomics and `_exit`). SA_RESTART keeps the system calls it
        // interrupts from failing with EINTR in code that does not retry them.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(sig, &action, std::ptr::null_mut());
        }
    }
    &CANCEL
}

/// The exit code for the signal that interrupted the run (130 for SIGINT, 143 for SIGTERM), if one
/// did.
pub fn exit_code() -> Option<u8> {
    match SIGNAL.load(Ordering::SeqCst) {
        0 => None,
        sig => Some(exit_code_of(sig)),
    }
}

fn exit_code_of(sig: libc::c_int) -> u8 {
    u8::try_from(128 + sig).unwrap_or(128)
}

extern "C" fn on_signal(sig: libc::c_int) {
    let first = SIGNAL
        .compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst)
        .is_ok();
    CANCEL.store(true, Ordering::SeqCst);
    if !first || ARMED.load(Ordering::SeqCst) == 0 {
        // SAFETY: `_exit` is async-signal-safe and ends the process without running anything
        // of ours, which may be in the middle of what this signal interrupted.
        unsafe { libc::_exit(exit_code_of(sig).into()) }
    }
}

/// Held while the process has something an exit would leave behind: a signal then asks the run
/// to stop and clean up instead of ending the process. Take it before making the thing, drop it
/// after undoing (or committing) it.
#[derive(Debug)]
pub(crate) struct Armed(());

impl Armed {
    pub(crate) fn new() -> Armed {
        ARMED.fetch_add(1, Ordering::SeqCst);
        Armed(())
    }
}

impl Drop for Armed {
    fn drop(&mut self) {
        ARMED.fetch_sub(1, Ordering::SeqCst);
    }
}
