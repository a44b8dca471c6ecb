//! The `ckpt` binary: parse flags, run, print errors, exit with a meaningful code.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = ckpt::cli::Cli::parse();
    // Ctrl-C and SIGTERM stop the run; the staging guards then remove what it made.
    let cancel = ckpt::interrupt::install();
    match ckpt::cli::run(cli, cancel) {
        Ok(code) => ExitCode::from(code as u8),
        Err(e) => {
            ckpt::cli::to_stderr(format_args!(
                "error: {}",
                ckpt::cli::terminal_safe(&e.to_string())
            ));
            if let Some(code) = ckpt::interrupt::exit_code() {
                return ExitCode::from(code);
            }
            ExitCode::from(match e.kind {
                ckpt::ErrorKind::Usage => 2,
                _ => 1,
            })
        }
    }
}
