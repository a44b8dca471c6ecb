//! The CI entry point (`scripts/test`, which `.ci/run` calls) runs the Rust gate, `cargo fmt
//! --check` and `cargo clippy -D warnings`, before it builds the Python venv the interop suite needs:
//! a formatting slip or a lint fails in seconds instead of after minutes of setup.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

mod common;
use common::TestEnv;

#[test]
fn the_rust_gate_runs_before_the_venv_is_built() {
    // A copy of the script in a scratch tree, so nothing it does can touch this checkout's venv,
    // and a `cargo` that logs its arguments and fails at clippy, as a lint would.
    let env = TestEnv::new();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/test");
    let copy = env.write("tree/scripts/test", &std::fs::read(&script).unwrap());
    let log = env.path("cargo.log");
    let cargo = env.write(
        "bin/cargo",
        format!(
            "#!/bin/sh\necho \"$*\" >> '{}'\n[ \"$1\" = clippy ] && exit 3\nexit 0\n",
            log.display()
        )
        .as_bytes(),
    );
    std::fs::set_permissions(&cargo, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!(
        "{}:{}",
        env.path("bin").display(),
        std::env::var("PATH").unwrap_or_default()
    );

    let out = Command::new("bash")
        .arg(&copy)
        .env("PATH", path)
        // Were the venv step first, it would fail here instead of building anything.
        .env("PYTHON", "false")
        .output()
        .expect("run scripts/test");

    let calls = std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(
        calls.lines().collect::<Vec<_>>(),
        ["fmt --check", "clippy --all-targets -- -D warnings"],
        "stdout: {}\nstderr: {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        out.status.code(),
        Some(3),
        "the gate's failure is the script's"
    );
    assert!(!env.path("tree/.venv").exists(), "the venv step ran");
}
