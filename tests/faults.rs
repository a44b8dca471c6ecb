//! Fault tests: kills, interrupts, full and read-only disks, inputs that change under ckpt. After
//! each, nothing may sit under the output's final name and temporaries must be gone or clearly
//! named and cleaned by the next run.

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use ckpt::dtype::DType;

/// A FULL safetensors file of `tensors` F32 tensors of `mib` MiB each (zeros; sparse on disk).
fn synthetic(path: &Path, tensors: usize, mib: u64) {
    let n = mib * (1 << 20) / 4;
    let entries: Vec<(String, DType, Vec<u64>)> = (0..tensors)
        .map(|i| (format!("layers.{i}.weight"), DType::F32, vec![n]))
        .collect();
    let (header, ranges) = ckpt::formats::safetensors::header_bytes(&entries, &[]);
    let file = std::fs::File::create(path).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&file, &header, 0).unwrap();
    file.set_len(header.len() as u64 + ranges.last().unwrap().1)
        .unwrap();
}

fn ckpt_cmd<S: AsRef<OsStr>>(args: &[S]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ckpt"));
    for a in args {
        cmd.arg(a);
    }
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd
}

fn leftovers(out: &Path) -> Vec<PathBuf> {
    ckpt::output::leftovers(out)
}

/// Start `args`, wait until its temporary output appears, and return the running child.
fn start_and_wait_for_temp<S: AsRef<OsStr>>(args: &[S], out: &Path) -> Child {
    let mut child = ckpt_cmd(args).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while leftovers(out).is_empty() {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("ckpt ended ({status}) before it was interrupted: make the input larger");
        }
        assert!(Instant::now() < deadline, "no temporary output appeared");
        std::thread::sleep(Duration::from_millis(1));
    }
    // Let it get into the copy.
    std::thread::sleep(Duration::from_millis(20));
    child
}

fn signal(child: &Child, sig: &str) {
    let status = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(child.id().to_string())
        .status()
        .unwrap();
    assert!(status.success());
}

fn finish(child: Child) -> Output {
    child.wait_with_output().unwrap()
}

/// A run slow enough to interrupt: `subcommand` on a 384 MiB input into `out_name`, one thread,
/// positional reads. Returns the temp dir (keep it alive), the input, the output and the arguments.
fn slow_run(
    subcommand: &[&str],
    out_name: &str,
) -> (tempfile::TempDir, PathBuf, PathBuf, Vec<OsString>) {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("big.safetensors");
    synthetic(&input, 48, 8);
    let out = tmp.path().join(out_name);
    let mut args: Vec<OsString> = subcommand.iter().map(OsString::from).collect();
    args.extend([input.as_os_str(), OsStr::new("-o"), out.as_os_str()].map(OsString::from));
    args.extend(["--threads", "1", "--io", "read", "-q"].map(OsString::from));
    (tmp, input, out, args)
}

fn kill_midway_then_rerun(subcommand: &[&str], out_name: &str) {
    let (_tmp, _input, out, args) = slow_run(subcommand, out_name);
    let child = start_and_wait_for_temp(&args, &out);
    signal(&child, "KILL");
    let result = finish(child);
    assert!(result.status.code().is_none(), "killed by a signal");
    assert!(
        !out.exists(),
        "a killed run left something under the final name"
    );
    let left = leftovers(&out);
    assert_eq!(left.len(), 1, "{left:?}");
    assert!(left[0]
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .contains(".ckpt-tmp-"));
    // A rerun succeeds and clears the dead run's temporary.
    let rerun = ckpt_cmd(&args).output().unwrap();
    assert!(
        rerun.status.success(),
        "{}",
        String::from_utf8_lossy(&rerun.stderr)
    );
    assert!(out.exists());
    assert!(leftovers(&out).is_empty(), "{:?}", leftovers(&out));
}

#[test]
fn sigkill_during_consolidate_leaves_nothing_under_the_final_name() {
    kill_midway_then_rerun(&["consolidate"], "model.safetensors");
}

#[test]
fn sigkill_during_reshard_leaves_nothing_under_the_final_name() {
    kill_midway_then_rerun(
        &[
            "reshard",
            "--world-size",
            "3",
            "--format",
            "dcp-safetensors",
        ],
        "sharded",
    );
}

#[test]
fn ctrl_c_stops_cleanly_and_removes_temporary_output() {
    let (_tmp, _input, out, args) = slow_run(&["consolidate"], "out.safetensors");
    let child = start_and_wait_for_temp(&args, &out);
    signal(&child, "INT");
    let result = finish(child);
    assert_eq!(
        result.status.code(),
        Some(130),
        "{}",
        String::from_utf8_lossy(&result.stderr)
    );
    assert!(String::from_utf8_lossy(&result.stderr).contains("interrupted"));
    assert!(!out.exists());
    assert!(leftovers(&out).is_empty(), "{:?}", leftovers(&out));
}

#[test]
fn ctrl_c_removes_the_directories_made_for_the_output() {
    let (tmp, _input, _, mut args) = slow_run(&["consolidate"], "unused");
    let out = tmp.path().join("new/deeper/out.safetensors");
    let at = args.iter().position(|a| a == "-o").unwrap() + 1;
    args[at] = out.clone().into_os_string();
    let child = start_and_wait_for_temp(&args, &out);
    signal(&child, "INT");
    let result = finish(child);
    assert_eq!(
        result.status.code(),
        Some(130),
        "{}",
        String::from_utf8_lossy(&result.stderr)
    );
    assert!(
        !tmp.path().join("new").exists(),
        "an interrupted run left the directories it made"
    );
}

#[test]
fn an_input_that_grows_during_the_run_is_an_error() {
    let (_tmp, input, out, args) = slow_run(&["consolidate"], "out.safetensors");
    let child = start_and_wait_for_temp(&args, &out);
    let file = std::fs::OpenOptions::new()
        .append(true)
        .open(&input)
        .unwrap();
    std::io::Write::write_all(
        &mut &file,
        b"more bytes from a writer that has not finished",
    )
    .unwrap();
    let result = finish(child);
    let err = String::from_utf8_lossy(&result.stderr);
    assert_eq!(result.status.code(), Some(1), "{err}");
    assert!(
        err.contains("changed size during the run") && err.contains("big.safetensors"),
        "{err}"
    );
    assert!(!out.exists());
    assert!(leftovers(&out).is_empty());
}

/// Mount a tmpfs at `dir` with `options`, or say why not and return false.
fn mount_tmpfs(dir: &Path, options: &str) -> bool {
    let ok = Command::new("mount")
        .args(["-t", "tmpfs", "-o", options, "tmpfs"])
        .arg(dir)
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("skipped: cannot mount a tmpfs here (needs root)");
    }
    ok
}

struct Unmount(PathBuf);
impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn a_full_disk_gives_a_clear_error_and_removes_temporaries() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("big.safetensors");
    synthetic(&input, 4, 1);
    let small = tmp.path().join("small");
    std::fs::create_dir(&small).unwrap();
    if !mount_tmpfs(&small, "size=1m") {
        return;
    }
    let _guard = Unmount(small.clone());
    let out = small.join("out.safetensors");
    let result = ckpt_cmd::<&dyn AsRef<OsStr>>(&[&"consolidate", &input, &"-o", &out, &"-q"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&result.stderr);
    assert_eq!(result.status.code(), Some(1), "{err}");
    assert!(
        err.contains("small/.out.safetensors.ckpt-tmp-") || err.contains("small/out.safetensors"),
        "{err}"
    );
    assert!(err.contains("No space left on device"), "{err}");
    assert!(!out.exists());
    assert!(leftovers(&out).is_empty(), "{:?}", leftovers(&out));
    assert_eq!(std::fs::read_dir(&small).unwrap().count(), 0);
}

#[test]
fn an_unwritable_output_directory_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("in.safetensors");
    synthetic(&input, 2, 1);
    let ro = tmp.path().join("ro");
    std::fs::create_dir(&ro).unwrap();
    if !mount_tmpfs(&ro, "size=1m,ro") {
        return;
    }
    let _guard = Unmount(ro.clone());
    let out = ro.join("out.safetensors");
    let result = ckpt_cmd::<&dyn AsRef<OsStr>>(&[&"consolidate", &input, &"-o", &out, &"-q"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&result.stderr);
    assert_eq!(result.status.code(), Some(1), "{err}");
    assert!(
        err.contains("Read-only file system") && err.contains("ro/"),
        "{err}"
    );
    assert!(!out.exists());
}

/// A FULL safetensors file of `tensors` F32 tensors of `elems` elements each (zeros).
fn many_small(path: &Path, tensors: usize, elems: u64) {
    let entries: Vec<(String, DType, Vec<u64>)> = (0..tensors)
        .map(|i| (format!("layers.{i}.weight"), DType::F32, vec![elems]))
        .collect();
    let (header, ranges) = ckpt::formats::safetensors::header_bytes(&entries, &[]);
    let file = std::fs::File::create(path).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&file, &header, 0).unwrap();
    file.set_len(header.len() as u64 + ranges.last().unwrap().1)
        .unwrap();
}

/// Send `sig` to `child`, then wait for it: its output, and how long it took to exit.
fn interrupt(child: Child, sig: &str) -> (Output, Duration) {
    let sent = Instant::now();
    signal(&child, sig);
    let result = finish(child);
    (result, sent.elapsed())
}

/// What is left in `dir` besides `keep`: an interrupted run must leave nothing there.
fn others(dir: &Path, keep: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p != keep)
        .collect()
}

#[test]
fn ctrl_c_while_the_metadata_of_a_reshard_to_1024_ranks_is_written_stops_within_3_s() {
    // 256 tensors over 1,024 ranks: a `.metadata` of 262,144 pieces, which this (debug) build
    // takes about 30 s to walk twice, on its own thread while the rank files are copied.
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("many.safetensors");
    many_small(&input, 256, 1024);
    let out = tmp.path().join("sharded");
    let args: Vec<&OsStr> = vec![
        OsStr::new("reshard"),
        input.as_os_str(),
        OsStr::new("-o"),
        out.as_os_str(),
        OsStr::new("--world-size"),
        OsStr::new("1024"),
        OsStr::new("-q"),
    ];
    let mut child = ckpt_cmd(&args).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let metadata = loop {
        if let Some(m) = leftovers(&out)
            .first()
            .map(|staging| staging.join(".metadata"))
            .filter(|m| m.exists())
        {
            break m;
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!("ckpt ended ({status}) before it was interrupted");
        }
        assert!(Instant::now() < deadline, "no staged .metadata appeared");
        std::thread::sleep(Duration::from_millis(1));
    };
    // Into the walk over the pieces.
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        metadata.exists(),
        "the .metadata was done already: make the input larger"
    );
    let (result, took) = interrupt(child, "INT");
    let err = String::from_utf8_lossy(&result.stderr);
    assert_eq!(result.status.code(), Some(130), "{err}");
    assert!(err.contains("interrupted"), "{err}");
    assert!(
        took < Duration::from_secs(3),
        "exited {took:?} after SIGINT"
    );
    assert!(!out.exists(), "an interrupted run left its output");
    assert_eq!(others(tmp.path(), &input), Vec::<PathBuf>::new());
}

#[test]
fn sigterm_during_the_copy_of_a_reshard_stops_within_3_s_and_removes_the_staging() {
    let (tmp, input, out, args) = slow_run(&["reshard", "--world-size", "4"], "sharded");
    let child = start_and_wait_for_temp(&args, &out);
    let (result, took) = interrupt(child, "TERM");
    let err = String::from_utf8_lossy(&result.stderr);
    assert_eq!(result.status.code(), Some(143), "{err}");
    assert!(
        took < Duration::from_secs(3),
        "exited {took:?} after SIGTERM"
    );
    assert!(!out.exists(), "an interrupted run left its output");
    assert_eq!(others(tmp.path(), &input), Vec::<PathBuf>::new());
}

#[test]
fn ctrl_c_while_reading_ends_at_once() {
    // Nothing is staged yet while the input is read, so the process ends without waiting for
    // the reader: here `inspect` of a header of 200,000 tensors.
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("many.safetensors");
    many_small(&input, 200_000, 1);
    let child = ckpt_cmd(&[OsStr::new("inspect"), input.as_os_str()])
        .spawn()
        .unwrap();
    // Well inside the reading, which takes this build seconds.
    std::thread::sleep(Duration::from_millis(300));
    let (result, took) = interrupt(child, "INT");
    assert_eq!(
        result.status.code(),
        Some(130),
        "{}",
        String::from_utf8_lossy(&result.stderr)
    );
    assert!(
        took < Duration::from_secs(1),
        "exited {took:?} after SIGINT"
    );
}
