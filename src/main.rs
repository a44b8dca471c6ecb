//! The `ckpt` binary: parse flags, run, print errors, exit with a meaningful code.

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use clap::Parser;

fn main() -> ExitCode {
    let cli = ckpt::cli::Cli::parse();
    let cancel = Arc::new(AtomicBool::new(false));
    let flag = cancel.clone();
    // Ctrl-C stops the workers; the staging guard then removes the temporary output.
    let _ = ctrlc::set_handler(move || flag.store(true, Ordering::SeqCst));
    match ckpt::cli::run(cli, cancel.clone()) {
        Ok(code) => ExitCode::from(code as u8),
        Err(e) => {
            ckpt::cli::to_stderr(format_args!(
                "error: {}",
                ckpt::cli::terminal_safe(&e.to_string())
            ));
            if cancel.load(Ordering::SeqCst) {
                return ExitCode::from(130);
            }
            ExitCode::from(match e.kind {
                ckpt::ErrorKind::Usage => 2,
                _ => 1,
            })
        }
    }
}
