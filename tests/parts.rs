//! Partitioned runs (`--part I/N`) of the real binary: N parts, at the same time or one after
//! another in any order, give the bytes of a single run; nothing appears under the output's name
//! before the last part; a part refuses a staging area of another run; killed and repeated parts
//! are harmless.

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use ckpt::dtype::DType;

mod common;
use common::{fixtures, TestEnv};

fn ckpt<S: AsRef<OsStr>>(args: &[S]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ckpt"));
    cmd.args(args).env("NO_COLOR", "1");
    cmd.output().expect("run ckpt")
}

fn code(out: &Output) -> i32 {
    out.status.code().unwrap_or(-1)
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn os(args: &[&dyn AsRef<OsStr>]) -> Vec<OsString> {
    args.iter().map(|a| a.as_ref().to_os_string()).collect()
}

/// Every file under `path` (or `path` itself), relative, with its bytes.
fn tree(path: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    if path.is_file() {
        out.insert(PathBuf::new(), std::fs::read(path).unwrap());
        return out;
    }
    let mut stack = vec![path.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.insert(
                    p.strip_prefix(path).unwrap().to_path_buf(),
                    std::fs::read(&p).unwrap(),
                );
            }
        }
    }
    out
}

fn assert_same(a: &Path, b: &Path, what: &str) {
    let (ta, tb) = (tree(a), tree(b));
    assert_eq!(
        ta.keys().collect::<Vec<_>>(),
        tb.keys().collect::<Vec<_>>(),
        "{what}: files differ"
    );
    for (k, bytes) in &ta {
        assert!(bytes == &tb[k], "{what}: `{}` differs", k.display());
    }
}

/// A FULL safetensors file of mixed dtypes and odd shapes, with pseudo-random bytes: about
/// `scale` × 700 KB, so that 4 KiB-aligned shares cut through headers and tensors.
fn synthetic(path: &Path, scale: u64) {
    let entries: Vec<(String, DType, Vec<u64>)> = vec![
        ("embed.weight".into(), DType::BF16, vec![301 * scale, 97]),
        ("layers.0.attn.q".into(), DType::F32, vec![129 * scale, 131]),
        ("layers.0.attn.scale".into(), DType::F32, vec![]),
        ("layers.0.mlp.up".into(), DType::BF16, vec![211 * scale, 67]),
        ("layers.0.empty".into(), DType::F16, vec![0, 5]),
        ("layers.1.attn.q".into(), DType::F32, vec![77 * scale, 129]),
        ("layers.1.mlp.up".into(), DType::I64, vec![33 * scale, 17]),
        ("norm.weight".into(), DType::BF16, vec![1013]),
    ];
    let (header, ranges) = ckpt::formats::safetensors::header_bytes(&entries, &[]);
    let len = ranges.last().unwrap().1 as usize;
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let data: Vec<u8> = (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    std::fs::write(path, [header, data].concat()).unwrap();
}

/// A DCP checkpoint over 3 ranks of [`synthetic`] (written by a single run), for inputs whose
/// tensors come in pieces.
fn dcp_input(env: &TestEnv) -> PathBuf {
    let full = env.path("full.safetensors");
    synthetic(&full, 1);
    let dcp = env.path("dcp_in");
    let out = ckpt(&os(&[
        &"reshard",
        &full,
        &"-o",
        &dcp,
        &"--world-size",
        &"3",
        &"-q",
    ]));
    assert_eq!(code(&out), 0, "{}", text(&out));
    dcp
}

/// One conversion: subcommand and input, output name, flags.
struct Case {
    what: &'static str,
    input: PathBuf,
    sub: &'static str,
    name: &'static str,
    flags: Vec<&'static str>,
}

impl Case {
    fn args(&self, out: &Path, part: Option<(usize, usize)>) -> Vec<OsString> {
        let mut args = os(&[&self.sub, &self.input, &"-o", &out, &"-q"]);
        args.extend(self.flags.iter().map(OsString::from));
        if let Some((i, n)) = part {
            args.push("--part".into());
            args.push(format!("{i}/{n}").into());
        }
        args
    }

    fn single(&self, env: &TestEnv) -> PathBuf {
        let out = env.path(&format!("single-{}", self.what)).join(self.name);
        std::fs::create_dir_all(out.parent().unwrap()).unwrap();
        let run = ckpt(&self.args(&out, None));
        assert_eq!(code(&run), 0, "{}: {}", self.what, text(&run));
        out
    }
}

fn cases(env: &TestEnv) -> Vec<Case> {
    let dcp = dcp_input(env);
    let adamw = fixtures().join("fsdp2_adamw");
    let zstd = fixtures().join("dcp_zstd");
    let case = |what, input: &Path, sub, name, flags: &[&'static str]| Case {
        what,
        input: input.to_path_buf(),
        sub,
        name,
        flags: flags.to_vec(),
    };
    vec![
        case("safetensors", &dcp, "consolidate", "m.safetensors", &[]),
        case(
            "split",
            &dcp,
            "consolidate",
            "split",
            &["--max-shard-size", "200KB"],
        ),
        case(
            "torch",
            &dcp,
            "consolidate",
            "m.bin",
            &["--format", "torch"],
        ),
        case(
            "torch-values",
            &adamw,
            "consolidate",
            "m.pt",
            &["--format", "torch"],
        ),
        case(
            "torch-bf16",
            &dcp,
            "consolidate",
            "m.bin",
            &["--format", "torch", "--dtype", "bf16"],
        ),
        case("reshard-dcp", &dcp, "reshard", "r", &["--world-size", "5"]),
        case(
            "reshard-mesh",
            &dcp,
            "reshard",
            "r",
            &["--mesh", "2x2", "--placements", "S(0),S(1)"],
        ),
        case(
            "reshard-values",
            &adamw,
            "reshard",
            "r",
            &["--world-size", "3"],
        ),
        case(
            "reshard-zstd",
            &zstd,
            "reshard",
            "r",
            &["--world-size", "2"],
        ),
        case(
            "reshard-dcp-safetensors",
            &dcp,
            "reshard",
            "r",
            &["--world-size", "3", "--format", "dcp-safetensors"],
        ),
    ]
}

#[test]
fn parts_at_the_same_time_give_the_bytes_of_a_single_run() {
    let env = TestEnv::new();
    for case in cases(&env) {
        let single = case.single(&env);
        for n in [2, 4] {
            let out = env.path(&format!("par{n}-{}", case.what)).join(case.name);
            std::fs::create_dir_all(out.parent().unwrap()).unwrap();
            let children: Vec<_> = (0..n)
                .map(|i| {
                    Command::new(env!("CARGO_BIN_EXE_ckpt"))
                        .args(case.args(&out, Some((i, n))))
                        .stdout(Stdio::piped())
                        .stderr(Stdio::piped())
                        .spawn()
                        .unwrap()
                })
                .collect();
            for child in children {
                let o = child.wait_with_output().unwrap();
                assert_eq!(code(&o), 0, "{} in {n}: {}", case.what, text(&o));
            }
            assert_same(
                &single,
                &out,
                &format!("{} in {n} parallel parts", case.what),
            );
            assert!(
                !ckpt::output::part::staging_of(&out).exists(),
                "the staging area is removed"
            );
        }
    }
}

#[test]
fn parts_one_after_another_in_reverse_give_the_bytes_of_a_single_run() {
    let env = TestEnv::new();
    for case in cases(&env) {
        let single = case.single(&env);
        let n = 5;
        let out = env.path(&format!("rev-{}", case.what)).join(case.name);
        std::fs::create_dir_all(out.parent().unwrap()).unwrap();
        for i in (0..n).rev() {
            let o = ckpt(&case.args(&out, Some((i, n))));
            assert_eq!(code(&o), 0, "{} part {i}: {}", case.what, text(&o));
            if i > 0 {
                assert!(
                    out.symlink_metadata().is_err(),
                    "{}: `{}` exists before the last part",
                    case.what,
                    out.display()
                );
            }
        }
        assert_same(
            &single,
            &out,
            &format!("{} in {n} parts, reversed", case.what),
        );
    }
}

#[test]
fn a_single_file_splits_into_balanced_shares() {
    let env = TestEnv::new();
    let input = env.path("full.safetensors");
    synthetic(&input, 4);
    let out = env.path("m.bin");
    let n = 3;
    let mut bytes = Vec::new();
    for i in 0..n {
        let o = ckpt(&os(&[
            &"consolidate",
            &input,
            &"-o",
            &out,
            &"--format",
            &"torch",
            &"--part",
            &format!("{i}/{n}"),
        ]));
        assert_eq!(code(&o), 0, "{}", text(&o));
        // `part 1/3: wrote 930.00 KiB of 2.72 MiB (1 file) into ...; 1 of 3 parts still missing: 2`
        let said = text(&o);
        let line = said
            .lines()
            .find(|l| l.starts_with(&format!("part {i}/{n}: wrote ")))
            .unwrap_or_else(|| panic!("no summary line in {said}"));
        assert!(line.contains("(1 file)"), "{line}");
        let missing = n - 1 - i;
        if missing > 0 {
            assert!(
                line.contains(&format!("{missing} of {n} parts still missing")),
                "{line}"
            );
            let marker =
                ckpt::output::part::staging_of(&out).join(format!("done/part-{i}-of-{n}.json"));
            let m: serde_json::Value =
                serde_json::from_slice(&std::fs::read(marker).unwrap()).unwrap();
            bytes.push(m["bytes"].as_u64().unwrap());
        } else {
            assert!(line.contains("all 3 parts done: committed"), "{line}");
        }
    }
    // The one output file, in three shares of about a third each (cuts fall on 4 KiB pages).
    let len = std::fs::metadata(&out).unwrap().len();
    bytes.push(len - bytes.iter().sum::<u64>());
    let mean = len as f64 / n as f64;
    for b in &bytes {
        assert!((*b as f64 - mean).abs() <= 4096.0, "{bytes:?} of {len}");
    }
    assert!(len > 500_000, "{len}");
}

#[test]
fn a_missing_part_leaves_nothing_under_the_output_name_and_verify_names_it() {
    let env = TestEnv::new();
    let input = dcp_input(&env);
    let out = env.path("m.safetensors");
    let part = |i: usize| {
        ckpt(&os(&[
            &"consolidate",
            &input,
            &"-o",
            &out,
            &"--part",
            &format!("{i}/4"),
        ]))
    };
    for i in [3, 0, 2] {
        let o = part(i);
        assert_eq!(code(&o), 0, "{}", text(&o));
    }
    assert!(out.symlink_metadata().is_err(), "nothing under the name");
    let staging = ckpt::output::part::staging_of(&out);
    for target in [&out, &staging, &staging.join("m.safetensors")] {
        let v = ckpt(&os(&[&"verify", target]));
        assert_eq!(code(&v), 1, "{}", text(&v));
        let said = text(&v);
        assert!(
            said.contains("unfinished partitioned run: 1 of 4 parts missing: 1"),
            "{said}"
        );
        assert!(
            said.contains("--part I/4"),
            "the hint gives the command: {said}"
        );
        let json = ckpt(&os(&[&"verify", target, &"--json"]));
        let doc: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
        assert_eq!(doc["unfinished"]["missing"], serde_json::json!([1]));
        assert_eq!(doc["unfinished"]["done"], serde_json::json!([0, 2, 3]));
    }
    let o = part(1);
    assert_eq!(code(&o), 0, "{}", text(&o));
    assert!(
        text(&o).contains("all 4 parts done: committed"),
        "{}",
        text(&o)
    );
    let v = ckpt(&os(&[&"verify", &out, &"--deep"]));
    assert_eq!(code(&v), 0, "{}", text(&v));
}

#[test]
fn a_repeated_part_is_idempotent() {
    let env = TestEnv::new();
    let input = dcp_input(&env);
    let single = env.path("single").join("m.bin");
    std::fs::create_dir_all(single.parent().unwrap()).unwrap();
    let args = |out: &Path, i: usize| {
        os(&[
            &"consolidate",
            &input,
            &"-o",
            &out,
            &"--format",
            &"torch",
            &"--part",
            &format!("{i}/3"),
            &"-q",
        ])
    };
    let o = ckpt(&os(&[
        &"consolidate",
        &input,
        &"-o",
        &single,
        &"--format",
        &"torch",
    ]));
    assert_eq!(code(&o), 0, "{}", text(&o));
    let out = env.path("m.bin");
    let staged = ckpt::output::part::staging_of(&out).join("m.bin");
    let marker = ckpt::output::part::staging_of(&out).join("done/part-1-of-3.json");
    assert_eq!(code(&ckpt(&args(&out, 1))), 0);
    let (bytes, mark) = (
        std::fs::read(&staged).unwrap(),
        std::fs::read(&marker).unwrap(),
    );
    let o = ckpt(&args(&out, 1));
    assert_eq!(code(&o), 0, "{}", text(&o));
    assert_eq!(std::fs::read(&staged).unwrap(), bytes, "same staged bytes");
    let strip_pid = |m: &[u8]| {
        let mut v: serde_json::Value = serde_json::from_slice(m).unwrap();
        v["pid"] = serde_json::Value::Null;
        v
    };
    assert_eq!(
        strip_pid(&std::fs::read(&marker).unwrap()),
        strip_pid(&mark),
        "same marker"
    );
    for i in [0, 1, 2, 1] {
        if out.exists() {
            break;
        }
        assert_eq!(code(&ckpt(&args(&out, i))), 0);
    }
    assert_same(&single, &out, "torch with a repeated part");
    // Once committed, a part run again refuses the existing output, as a plain run does.
    let o = ckpt(&args(&out, 1));
    assert_eq!(code(&o), 2, "{}", text(&o));
    assert!(text(&o).contains("already exists"), "{}", text(&o));
}

#[test]
fn parts_of_another_run_are_refused() {
    let env = TestEnv::new();
    let input = dcp_input(&env);
    let out = env.path("m.safetensors");
    let run = |i: &str, extra: &[&str]| {
        let mut args = os(&[&"consolidate", &input, &"-o", &out, &"--part", &i]);
        args.extend(extra.iter().map(OsString::from));
        ckpt(&args)
    };
    let o = run("0/3", &["--dtype", "bf16"]);
    assert_eq!(code(&o), 0, "{}", text(&o));
    // Other flags, another part count, another input (the same file, changed since).
    let flags = run("1/3", &[]);
    assert_eq!(code(&flags), 2, "{}", text(&flags));
    assert!(
        text(&flags).contains("holds a partitioned run of another input, other flags"),
        "{}",
        text(&flags)
    );
    assert!(
        text(&flags).contains("--dtype bf16"),
        "names how it was started: {}",
        text(&flags)
    );
    assert!(text(&flags).contains("hint: "), "{}", text(&flags));
    let count = run("1/4", &["--dtype", "bf16"]);
    assert_eq!(code(&count), 2, "{}", text(&count));
    assert!(
        text(&count).contains("of 3 parts, not 4"),
        "{}",
        text(&count)
    );
    let meta = input.join(".metadata");
    let f = std::fs::File::options().append(true).open(&meta).unwrap();
    let seen = f.metadata().unwrap().modified().unwrap();
    f.set_modified(seen + Duration::from_secs(10)).unwrap();
    let changed = run("1/3", &["--dtype", "bf16"]);
    assert_eq!(code(&changed), 2, "{}", text(&changed));
    // Back as the first part saw it; threads and --io do not change the bytes, so they may
    // differ between parts.
    f.set_modified(seen).unwrap();
    let o = run(
        "1/3",
        &["--dtype", "bf16", "--threads", "1", "--io", "read"],
    );
    assert_eq!(code(&o), 0, "{}", text(&o));
    assert!(out.symlink_metadata().is_err());
}

#[test]
fn bad_part_specs_are_usage_errors() {
    let env = TestEnv::new();
    let input = fixtures().join("single.safetensors");
    for bad in ["4/4", "0/0", "1", "x/2", "-1/2"] {
        let o = ckpt(&os(&[
            &"consolidate",
            &input,
            &"-o",
            &env.path("m.bin"),
            &"--part",
            &bad,
        ]));
        assert_eq!(code(&o), 2, "{bad}: {}", text(&o));
    }
    let o = ckpt(&os(&[
        &"reshard",
        &input,
        &"-o",
        &env.path("r"),
        &"--world-size",
        &"2",
        &"--part",
        &"2/2",
    ]));
    assert_eq!(code(&o), 2, "{}", text(&o));
    assert!(text(&o).contains("numbered from 0 to 1"), "{}", text(&o));
    assert!(env.snapshot().is_empty(), "nothing written");
}

#[test]
fn an_existing_output_is_refused_without_force_and_replaced_with_it() {
    let env = TestEnv::new();
    let input = dcp_input(&env);
    let out = env.write("m.safetensors", b"old");
    let run = |i: usize, force: bool| {
        let mut args = os(&[
            &"consolidate",
            &input,
            &"-o",
            &out,
            &"--part",
            &format!("{i}/2"),
        ]);
        if force {
            args.push("--force".into());
        }
        ckpt(&args)
    };
    let o = run(0, false);
    assert_eq!(code(&o), 2, "{}", text(&o));
    assert!(text(&o).contains("already exists"), "{}", text(&o));
    assert_eq!(code(&run(0, true)), 0);
    assert_eq!(
        std::fs::read(&out).unwrap(),
        b"old",
        "untouched until the commit"
    );
    let v = ckpt(&os(&[&"verify", &out]));
    assert!(
        text(&v).contains("warning: ") && text(&v).contains("staged beside it"),
        "{}",
        text(&v)
    );
    assert_eq!(code(&run(1, true)), 0);
    let v = ckpt(&os(&[&"verify", &out, &"--deep"]));
    assert_eq!(code(&v), 0, "{}", text(&v));
    assert!(!text(&v).contains("staged beside it"), "{}", text(&v));
}

#[test]
fn a_stale_commit_lock_of_this_host_is_cleared_and_one_of_another_host_refused() {
    let env = TestEnv::new();
    let input = dcp_input(&env);
    let out = env.path("m.bin");
    let run = |i: usize| {
        ckpt(&os(&[
            &"consolidate",
            &input,
            &"-o",
            &out,
            &"--format",
            &"torch",
            &"--part",
            &format!("{i}/2"),
        ]))
    };
    assert_eq!(code(&run(0)), 0);
    let lock = ckpt::output::part::staging_of(&out).join("commit.lock");
    std::fs::write(&lock, "part 1/2 on some-other-host (pid 12)").unwrap();
    let o = run(1);
    assert_eq!(code(&o), 1, "{}", text(&o));
    assert!(
        text(&o).contains("being committed by part 1/2 on some-other-host"),
        "{}",
        text(&o)
    );
    assert!(out.symlink_metadata().is_err());
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    // A pid above the kernel's limit (4194304) is never alive.
    std::fs::write(&lock, format!("part 0/2 on {} (pid 4194305)", host.trim())).unwrap();
    let o = run(1);
    assert_eq!(code(&o), 0, "{}", text(&o));
    assert!(text(&o).contains("committed"), "{}", text(&o));
    assert!(out.is_file());
}

#[test]
fn a_killed_part_can_be_run_again() {
    let env = TestEnv::new();
    let input = env.path("big.safetensors");
    // About 90 MB of data: large enough to kill a part midway at one thread and plain reads.
    synthetic(&input, 128);
    let single = env.path("single").join("m.bin");
    std::fs::create_dir_all(single.parent().unwrap()).unwrap();
    let args = |out: &Path, part: Option<usize>| {
        let mut a = os(&[
            &"consolidate",
            &input,
            &"-o",
            &out,
            &"--format",
            &"torch",
            &"--threads",
            &"1",
            &"--io",
            &"read",
            &"-q",
        ]);
        if let Some(i) = part {
            a.push("--part".into());
            a.push(format!("{i}/2").into());
        }
        a
    };
    let o = ckpt(&args(&single, None));
    assert_eq!(code(&o), 0, "{}", text(&o));
    let out = env.path("m.bin");
    let staged = ckpt::output::part::staging_of(&out).join("m.bin");
    let mut child = Command::new(env!("CARGO_BIN_EXE_ckpt"))
        .args(args(&out, Some(0)))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !staged.exists() {
        assert!(Instant::now() < deadline, "no staged output appeared");
        assert!(
            child.try_wait().unwrap().is_none(),
            "the part ended before it was killed"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    // Killed as soon as its staged file appears: a pause here let a quiet machine finish the
    // part's 45 MB before the kill.
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let marker = ckpt::output::part::staging_of(&out).join("done/part-0-of-2.json");
    assert!(!marker.exists(), "a killed part leaves no marker");
    let o = ckpt(&args(&out, Some(1)));
    assert_eq!(code(&o), 0, "{}", text(&o));
    assert!(out.symlink_metadata().is_err(), "part 0 is missing");
    let o = ckpt(&args(&out, Some(0)));
    assert_eq!(code(&o), 0, "{}", text(&o));
    assert_same(&single, &out, "torch after a killed part ran again");
}
