//! Integration tests of the `ckpt` binary on the committed fixtures (written by real PyTorch, see
//! `fixtures/generate.py`). Every test works in its own temporary directory.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

mod common;
use common::{copy_tree, fixtures, TestEnv};

/// Every checkpoint fixture, by the name of its `fixtures/expected/<name>.json`.
const FIXTURES: &[(&str, &str)] = &[
    ("fsdp2_adamw", "fsdp2_adamw"),
    ("mesh_2x2", "mesh_2x2"),
    ("dtypes", "dtypes"),
    ("dcp_hf", "dcp_hf"),
    ("dcp_zstd", "dcp_zstd"),
    ("single", "single.safetensors"),
    ("hf_split", "hf_split"),
    ("torch_save", "torch_save.bin"),
    ("dtypes_safetensors", "dtypes.safetensors"),
    ("dtypes_torch_save", "dtypes_torch_save.pt"),
    ("dtypes_torch_dcp", "dtypes_torch_dcp"),
];

/// ckpt's codes for the torch dtypes safetensors cannot hold.
const TORCH_ONLY: &[&str] = &["C128", "C32", "F4_E2M1FN_X2"];

/// Whether the fixture `expected` (its `expected/<name>.json`) holds a dtype safetensors lacks.
fn holds_torch_only(expected: &str) -> bool {
    let doc: Value = serde_json::from_slice(
        &std::fs::read(fixtures().join("expected").join(format!("{expected}.json"))).unwrap(),
    )
    .unwrap();
    doc["tensors"]
        .as_object()
        .unwrap()
        .values()
        .any(|t| TORCH_ONLY.contains(&t["dtype"].as_str().unwrap()))
}

fn ckpt(args: &[&dyn AsRef<std::ffi::OsStr>]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ckpt"));
    for a in args {
        cmd.arg(a);
    }
    cmd.output().expect("run ckpt")
}

fn code(out: &Output) -> i32 {
    out.status.code().unwrap_or(-1)
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn inspect_json(path: &Path) -> Value {
    let out = ckpt(&[&"inspect", &path, &"--json"]);
    assert_eq!(
        code(&out),
        0,
        "inspect {}: {}",
        path.display(),
        stderr(&out)
    );
    serde_json::from_slice(&out.stdout).expect("inspect --json prints JSON")
}

#[test]
fn inspect_reports_every_tensor_as_pytorch_saved_it() {
    for (expected, path) in FIXTURES {
        let want: Value = serde_json::from_slice(
            &std::fs::read(fixtures().join("expected").join(format!("{expected}.json"))).unwrap(),
        )
        .unwrap();
        let got = inspect_json(&fixtures().join(path));
        assert_eq!(got["state_dict_type"], want["state_dict_type"], "{path}");
        if want["world_size"].is_number() {
            assert_eq!(got["world_size"], want["world_size"], "{path}");
        }
        let want_tensors = want["tensors"].as_object().unwrap();
        let got_tensors = got["tensors"].as_array().unwrap();
        assert_eq!(
            got_tensors.len(),
            want_tensors.len(),
            "{path}: tensor count"
        );
        for t in got_tensors {
            let name = t["name"].as_str().unwrap();
            let w = &want_tensors[name];
            assert_eq!(t["dtype"], w["dtype"], "{path}: {name}");
            assert_eq!(t["shape"], w["shape"], "{path}: {name}");
        }
        let mut want_values: Vec<&str> = want["non_tensors"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        let mut got_values: Vec<&str> = got["non_tensors"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v["name"].as_str().unwrap())
            .collect();
        want_values.sort();
        got_values.sort();
        assert_eq!(got_values, want_values, "{path}: non-tensor entries");
    }
}

#[test]
fn inspect_table_filters_by_glob() {
    let out = ckpt(&[
        &"inspect",
        &fixtures().join("fsdp2_adamw"),
        &"--filter",
        &"model.*",
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("SHARDED_STATE_DICT"));
    assert!(text.contains("model.embed.weight"));
    assert!(!text.contains("exp_avg"));
}

#[test]
fn verify_passes_every_fixture_deeply() {
    for (_, path) in FIXTURES {
        let out = ckpt(&[&"verify", &fixtures().join(path), &"--deep"]);
        assert_eq!(
            code(&out),
            0,
            "{path}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            stderr(&out)
        );
    }
}

/// Run verify and expect exit 1 with `needle` in its report.
fn assert_unsound(path: &Path, needle: &str) {
    let out = ckpt(&[&"verify", &path]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &stderr(&out);
    assert_eq!(code(&out), 1, "{}: {text}", path.display());
    assert!(text.contains(needle), "expected `{needle}` in: {text}");
}

#[test]
fn verify_finds_a_truncated_distcp() {
    let env = TestEnv::new();
    let dir = env.copy_fixture("fsdp2_adamw");
    let file = dir.join("__2_0.distcp");
    let len = std::fs::metadata(&file).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(len - 100)
        .unwrap();
    assert_unsound(&dir, "__2_0.distcp");
}

#[test]
fn verify_finds_a_missing_distcp() {
    let env = TestEnv::new();
    let dir = env.copy_fixture("mesh_2x2");
    std::fs::remove_file(dir.join("__1_0.distcp")).unwrap();
    assert_unsound(&dir, "__1_0.distcp");
}

#[test]
fn verify_finds_a_missing_middle_rank_in_dcp_safetensors() {
    let env = TestEnv::new();
    let dir = env.copy_fixture("dcp_hf");
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("shard-00002-")
        {
            std::fs::remove_file(p).unwrap();
        }
    }
    assert_unsound(&dir, "in no piece");
}

#[test]
fn verify_refuses_a_metadata_pickle_that_would_run_a_command() {
    let env = TestEnv::new();
    let dir = env.copy_fixture("dtypes");
    let marker = env.path("pwned");
    // pickle protocol 2: posix.system("touch <marker>")
    let command = format!("touch {}", marker.display());
    let mut evil = b"\x80\x02cposix\nsystem\nX".to_vec();
    evil.extend_from_slice(&(command.len() as u32).to_le_bytes());
    evil.extend_from_slice(command.as_bytes());
    evil.extend_from_slice(b"\x85R.");
    std::fs::write(dir.join(".metadata"), evil).unwrap();
    assert_unsound(&dir, "posix.system");
    assert!(!marker.exists(), "the pickle's command ran");
}

#[test]
fn verify_finds_a_safetensors_file_shorter_than_its_header() {
    let env = TestEnv::new();
    let file = env.copy_fixture("single.safetensors");
    let len = std::fs::metadata(&file).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(len - 10)
        .unwrap();
    assert_unsound(&file, "single.safetensors");
}

#[test]
fn verify_refuses_an_index_that_climbs_out() {
    let env = TestEnv::new();
    let dir = env.copy_fixture("hf_split");
    let index_path = dir.join("model.safetensors.index.json");
    let mut index: Value = serde_json::from_slice(&std::fs::read(&index_path).unwrap()).unwrap();
    let map = index["weight_map"].as_object_mut().unwrap();
    let first = map.keys().next().unwrap().clone();
    map[&first] = Value::String("../model-00001-of-00003.safetensors".into());
    std::fs::write(&index_path, serde_json::to_vec(&index).unwrap()).unwrap();
    assert_unsound(&dir, "../model-00001-of-00003.safetensors");
}

#[test]
fn verify_exits_2_on_a_missing_path() {
    let env = TestEnv::new();
    let out = ckpt(&[&"verify", &env.path("nothing-here")]);
    assert_eq!(code(&out), 2, "{}", stderr(&out));
    assert!(stderr(&out).contains("does not exist"));
}

#[test]
fn a_directory_holding_a_checkpoint_gets_a_hint() {
    let env = TestEnv::new();
    let outer = env.path("run");
    std::fs::create_dir(&outer).unwrap();
    copy_tree(
        &fixtures().join("dtypes"),
        &outer.join("pytorch_model_fsdp_0"),
    );
    let out = ckpt(&[&"inspect", &outer]);
    assert_eq!(code(&out), 1);
    assert!(
        stderr(&out).contains("pytorch_model_fsdp_0"),
        "{}",
        stderr(&out)
    );
}

/// accelerate's `save_fsdp_model` + `save_fsdp_optimizer` output directory: the hint names both
/// checkpoints in it, the model first.
#[test]
fn the_hint_names_every_checkpoint_one_level_down_model_first() {
    let env = TestEnv::new();
    let outer = env.path("checkpoint-100");
    copy_tree(&fixtures().join("dtypes"), &outer.join("optimizer_0"));
    copy_tree(
        &fixtures().join("dcp_zstd"),
        &outer.join("pytorch_model_fsdp_0"),
    );
    std::fs::write(outer.join("random_states_0.pkl"), b"not a checkpoint").unwrap();
    let out = ckpt(&[&"consolidate", &outer, &"-o", &env.path("out.safetensors")]);
    let err = stderr(&out);
    assert_eq!(code(&out), 1, "{err}");
    let hint = err
        .lines()
        .find(|l| l.contains("hint:"))
        .unwrap_or_default();
    let model = hint.find("pytorch_model_fsdp_0");
    let optim = hint.find("optimizer_0");
    assert!(
        model.is_some() && optim.is_some() && model < optim,
        "the hint should name the model, then the optimizer: {err}"
    );
    assert!(!env.path("out.safetensors").exists());
}

/// Tensors of dtypes ckpt does not support (safetensors F4, torch.bits8, torch.bcomplex32, as
/// the real libraries write them) block a run only while the selection keeps them.
#[test]
fn excluded_tensors_of_unsupported_dtypes_never_block_a_run() {
    let env = TestEnv::new();
    let cases = [
        ("f4.safetensors", "packed", "`F4`", "w"),
        ("bits8.pt", "bits", "`torch.bits8`", "w"),
        (
            "bcomplex32_dcp",
            "model.bc",
            "`torch.bcomplex32`",
            "model.w",
        ),
    ];
    for (file, bad, dtype, good) in cases {
        let input = fixtures().join("unsupported_dtypes").join(file);
        let kept = env.path(&format!("{file}-kept.bin"));
        let out = ckpt(&[&"consolidate", &input, &"-o", &kept, &"--format", &"torch"]);
        let err = stderr(&out);
        assert_eq!(code(&out), 1, "{file}: {err}");
        assert!(
            err.contains(&format!("`{bad}`")) && err.contains(dtype),
            "{err}"
        );
        assert!(err.contains(&format!("--exclude '{bad}'")), "{err}");
        assert!(!kept.exists());

        for (flag, glob) in [("--exclude", bad), ("--include", good)] {
            let full = env.path(&format!("{file}{flag}.bin"));
            let out = ckpt(&[
                &"consolidate",
                &input,
                &"-o",
                &full,
                &"--format",
                &"torch",
                &flag,
                &glob,
                &"-q",
            ]);
            assert_eq!(code(&out), 0, "{file} {flag} {glob}: {}", stderr(&out));
            let names: Vec<Value> = inspect_json(&full)["tensors"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t["name"].clone())
                .collect();
            assert_eq!(names, [good], "{file} {flag}");
        }
        let sharded = env.path(&format!("{file}-sharded"));
        let out = ckpt(&[
            &"reshard",
            &input,
            &"-o",
            &sharded,
            &"--world-size",
            &"2",
            &"--exclude",
            &bad,
            &"-q",
        ]);
        assert_eq!(code(&out), 0, "{file}: {}", stderr(&out));

        // inspect shows it apart (unless filtered out); verify says it cannot check it
        let listed = inspect_json(&input);
        assert_eq!(listed["unsupported"][0]["name"], bad, "{listed}");
        let filtered = ckpt(&[&"inspect", &input, &"--json", &"--filter", &good]);
        let filtered: Value = serde_json::from_slice(&filtered.stdout).unwrap();
        assert!(filtered.get("unsupported").is_none(), "{filtered}");
        let out = ckpt(&[&"verify", &input]);
        assert_eq!(code(&out), 1, "{file}");
    }
}

/// `-o` into directories that do not exist yet creates them; a run that refuses creates nothing,
/// and nothing is ever created inside the input.
#[test]
fn missing_parent_directories_of_the_output_are_created() {
    let env = TestEnv::new();
    let file = env.path("new/deeper/model.safetensors");
    let out = ckpt(&[
        &"consolidate",
        &fixtures().join("dtypes"),
        &"-o",
        &file,
        &"-q",
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let cmp = ckpt(&[&"verify", &file, &"--against", &fixtures().join("dtypes")]);
    assert_eq!(code(&cmp), 0, "{}", String::from_utf8_lossy(&cmp.stdout));

    let dir = env.path("runs/7/sharded");
    let out = ckpt(&[
        &"reshard",
        &fixtures().join("dtypes_torch_dcp"),
        &"-o",
        &dir,
        &"--world-size",
        &"3",
        &"-q",
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(dir.join(".metadata").is_file());

    // Refused (safetensors cannot hold complex128): no directory left behind.
    let refused = env.path("other/x.safetensors");
    let out = ckpt(&[
        &"consolidate",
        &fixtures().join("dtypes_torch_dcp"),
        &"-o",
        &refused,
    ]);
    assert_eq!(code(&out), 2, "{}", stderr(&out));
    assert!(!env.path("other").exists());

    // Never inside the input, even where the output's directory would be new.
    let input = env.copy_fixture("hf_split");
    let before = env.snapshot();
    let inside = input.join("sub/out.safetensors");
    let out = ckpt(&[&"consolidate", &input, &"-o", &inside]);
    assert_eq!(code(&out), 2, "{}", stderr(&out));
    assert_eq!(env.snapshot(), before);
}

#[test]
fn verify_against_compares_layouts() {
    let out = ckpt(&[
        &"verify",
        &fixtures().join("hf_split"),
        &"--against",
        &fixtures().join("single.safetensors"),
    ]);
    // The two fixtures hold different models: the comparison must say so.
    assert_eq!(code(&out), 1, "{}", String::from_utf8_lossy(&out.stdout));
}

/// consolidate and reshard every fixture, then compare the logical tensors with the input.
#[test]
fn every_fixture_survives_consolidate_and_reshard() {
    let env = TestEnv::new();
    for (name, path) in FIXTURES {
        let input = fixtures().join(path);
        let torch_only = holds_torch_only(name);
        let outputs: Vec<(String, Vec<String>)> = vec![
            (format!("{name}.safetensors"), vec![]),
            (
                format!("{name}-split"),
                vec!["--max-shard-size".into(), "200B".into()],
            ),
            (
                format!("{name}.bin"),
                vec!["--format".into(), "torch".into()],
            ),
        ];
        for (out_name, extra) in outputs {
            let out_path = env.path(&out_name);
            let mut args: Vec<&dyn AsRef<std::ffi::OsStr>> =
                vec![&"consolidate", &input, &"-o", &out_path, &"-q"];
            for e in &extra {
                args.push(e);
            }
            let out = ckpt(&args);
            if torch_only && !out_name.ends_with(".bin") {
                // safetensors cannot hold complex128, complex32 or packed fp4
                assert_eq!(code(&out), 2, "{out_name}: {}", stderr(&out));
                assert!(stderr(&out).contains("--format torch"), "{}", stderr(&out));
                continue;
            }
            assert_eq!(
                code(&out),
                0,
                "consolidate {path} -> {out_name}: {}",
                stderr(&out)
            );
            let cmp = ckpt(&[&"verify", &out_path, &"--against", &input]);
            assert_eq!(
                code(&cmp),
                0,
                "{out_name}: {}",
                String::from_utf8_lossy(&cmp.stdout)
            );
        }
        for n in ["1", "3", "8"] {
            for format in ["dcp", "dcp-safetensors"] {
                let out_path = env.path(&format!("{name}-{format}-{n}"));
                let out = ckpt(&[
                    &"reshard",
                    &input,
                    &"-o",
                    &out_path,
                    &"--world-size",
                    &n,
                    &"--format",
                    &format,
                    &"-q",
                ]);
                if torch_only && format == "dcp-safetensors" {
                    assert_eq!(code(&out), 2, "{name} {format}: {}", stderr(&out));
                    continue;
                }
                assert_eq!(
                    code(&out),
                    0,
                    "reshard {path} -> {n} {format}: {}",
                    stderr(&out)
                );
                let cmp = ckpt(&[&"verify", &out_path, &"--against", &input]);
                assert_eq!(
                    code(&cmp),
                    0,
                    "{name} {format} {n}: {}",
                    String::from_utf8_lossy(&cmp.stdout)
                );
            }
        }
    }
}

#[test]
fn split_output_has_an_index_matching_its_files() {
    let env = TestEnv::new();
    let out_dir = env.path("split");
    let out = ckpt(&[
        &"consolidate",
        &fixtures().join("fsdp2_adamw"),
        &"-o",
        &out_dir,
        &"--max-shard-size",
        &"300B",
        &"--include",
        &"model.*",
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let index: Value = serde_json::from_slice(
        &std::fs::read(out_dir.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let files: std::collections::BTreeSet<&str> = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(files.len() >= 3, "{files:?}");
    let on_disk: std::collections::BTreeSet<String> = std::fs::read_dir(&out_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    assert_eq!(
        on_disk
            .iter()
            .map(String::as_str)
            .collect::<std::collections::BTreeSet<_>>(),
        files
    );
    for (name, file) in index["weight_map"].as_object().unwrap() {
        let listed = inspect_json(&out_dir.join(file.as_str().unwrap()));
        assert!(
            listed["tensors"]
                .as_array()
                .unwrap()
                .iter()
                .any(|t| t["name"] == *name),
            "{name} not in {file}"
        );
    }
}

#[test]
fn consolidate_refuses_to_overwrite_without_force() {
    let env = TestEnv::new();
    let out_path = env.path("model.safetensors");
    std::fs::write(&out_path, b"precious").unwrap();
    let out = ckpt(&[&"consolidate", &fixtures().join("dtypes"), &"-o", &out_path]);
    assert_eq!(code(&out), 2, "{}", stderr(&out));
    assert!(stderr(&out).contains("--force"));
    assert_eq!(std::fs::read(&out_path).unwrap(), b"precious");
    let out = ckpt(&[
        &"consolidate",
        &fixtures().join("dtypes"),
        &"-o",
        &out_path,
        &"--force",
        &"-q",
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_ne!(std::fs::read(&out_path).unwrap(), b"precious");
}

#[test]
fn consolidate_refuses_an_output_inside_or_equal_to_the_input() {
    let env = TestEnv::new();
    let input = env.copy_fixture("single.safetensors");
    let before = std::fs::read(&input).unwrap();
    let out = ckpt(&[&"consolidate", &input, &"-o", &input, &"--force"]);
    assert_eq!(code(&out), 2, "{}", stderr(&out));
    assert_eq!(std::fs::read(&input).unwrap(), before);
    let dir = env.copy_fixture("dtypes");
    let out = ckpt(&[&"consolidate", &dir, &"-o", &dir.join("out.safetensors")]);
    assert_eq!(code(&out), 2, "{}", stderr(&out));
    assert!(!dir.join("out.safetensors").exists());
}

#[test]
fn consolidate_is_deterministic() {
    let env = TestEnv::new();
    // Same file name in two places: torch.save archives are named after their file.
    std::fs::create_dir(env.path("a")).unwrap();
    std::fs::create_dir(env.path("b")).unwrap();
    let (a, b) = (env.path("a/model.bin"), env.path("b/model.bin"));
    for p in [&a, &b] {
        let out = ckpt(&[
            &"consolidate",
            &fixtures().join("fsdp2_adamw"),
            &"-o",
            p,
            &"-q",
            &"--threads",
            &"2",
        ]);
        assert_eq!(code(&out), 0, "{}", stderr(&out));
    }
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
}

#[test]
fn a_manifest_from_a_sharded_checkpoint_checks_its_consolidated_output() {
    let env = TestEnv::new();
    let manifest = env.path("manifest.json");
    let input = fixtures().join("dcp_hf");
    let out = ckpt(&[&"verify", &input, &"--write-manifest", &manifest]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let full = env.path("model.safetensors");
    let out = ckpt(&[&"consolidate", &input, &"-o", &full, &"-q"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let out = ckpt(&[&"verify", &full, &"--manifest", &manifest]);
    assert_eq!(code(&out), 0, "{}", String::from_utf8_lossy(&out.stdout));
    // Silent corruption of one data byte (the last byte of the file is tensor data).
    let mut bytes = std::fs::read(&full).unwrap();
    *bytes.last_mut().unwrap() ^= 0x40;
    std::fs::write(&full, bytes).unwrap();
    let out = ckpt(&[&"verify", &full, &"--manifest", &manifest]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(code(&out), 1, "{text}");
    assert!(text.contains("does not match the manifest"), "{text}");
}

/// Resharding to the world size PyTorch saved with reproduces PyTorch's chunks exactly (empty
/// trailing chunks included).
#[test]
fn reshard_reproduces_the_chunks_dtensor_saved() {
    let env = TestEnv::new();
    let want: Value =
        serde_json::from_slice(&std::fs::read(fixtures().join("expected/dtypes.json")).unwrap())
            .unwrap();
    let out_path = env.path("dtypes-4");
    let out = ckpt(&[
        &"reshard",
        &fixtures().join("dtypes"),
        &"-o",
        &out_path,
        &"--world-size",
        &"4",
        &"-q",
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let got = inspect_json(&out_path);
    for t in got["tensors"].as_array().unwrap() {
        let name = t["name"].as_str().unwrap();
        let mut got_chunks: Vec<Value> = t["pieces"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| serde_json::json!([p["offsets"], p["sizes"]]))
            .collect();
        let mut want_chunks = want["tensors"][name]["chunks"].as_array().unwrap().clone();
        let key = |v: &Value| v.to_string();
        got_chunks.sort_by_key(key);
        want_chunks.sort_by_key(key);
        assert_eq!(got_chunks, want_chunks, "{name}");
    }
}

#[test]
fn deep_verify_warns_about_nan_and_inf_but_passes() {
    let out = ckpt(&[&"verify", &fixtures().join("dtypes"), &"--deep", &"--json"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let warnings: Vec<&Value> = report["problems"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["severity"] == "warning")
        .collect();
    assert!(
        warnings
            .iter()
            .any(|w| w["message"].as_str().unwrap().contains("NaN")),
        "{warnings:?}"
    );
    assert!(report["checksums"].as_object().unwrap().len() > 10);
}

#[test]
fn reshard_stores_replicated_tensors_once_on_rank_0() {
    let env = TestEnv::new();
    let input = fixtures().join("fsdp2_adamw");
    let out_path = env.path("replicated");
    let out = ckpt(&[
        &"reshard",
        &input,
        &"-o",
        &out_path,
        &"--world-size",
        &"3",
        &"--replicate",
        &"model.norm.*",
        &"-q",
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let got = inspect_json(&out_path);
    let mut seen = 0;
    for t in got["tensors"].as_array().unwrap() {
        let pieces = t["pieces"].as_array().unwrap();
        if t["name"].as_str().unwrap().starts_with("model.norm.") {
            seen += 1;
            assert_eq!(pieces.len(), 1, "{t}");
            assert_eq!(pieces[0]["file"], "__0_0.distcp");
            assert_eq!(pieces[0]["sizes"], t["shape"]);
        } else if t["shape"]
            .as_array()
            .unwrap()
            .first()
            .and_then(Value::as_u64)
            >= Some(3)
        {
            assert_eq!(pieces.len(), 3, "{t}");
        }
    }
    assert_eq!(seen, 2);
    let cmp = ckpt(&[&"verify", &out_path, &"--against", &input]);
    assert_eq!(code(&cmp), 0, "{}", String::from_utf8_lossy(&cmp.stdout));
}

#[test]
fn inspect_infers_the_mesh_from_how_tensors_are_cut() {
    assert_eq!(
        inspect_json(&fixtures().join("fsdp2_adamw"))["mesh"],
        serde_json::json!([4])
    );
    assert_eq!(
        inspect_json(&fixtures().join("single.safetensors"))["mesh"],
        Value::Null
    );
    let env = TestEnv::new();
    let out_path = env.path("mesh");
    let out = ckpt(&[
        &"reshard",
        &fixtures().join("fsdp2_adamw"),
        &"-o",
        &out_path,
        &"--mesh",
        &"2x2",
        &"--placements",
        &"S(0),S(1)",
        &"-q",
    ]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let got = inspect_json(&out_path);
    assert_eq!(got["mesh"], serde_json::json!([2, 2]));
    assert_eq!(got["world_size"], 4);
}

/// `ckpt generate-shell-completion SHELL` prints a script that completes every subcommand and
/// their flags; bash's is also loaded into a real bash, which must register it for `ckpt`.
#[test]
fn shell_completions_name_the_subcommands_and_flags() {
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        let out = ckpt(&[&"generate-shell-completion", &shell]);
        assert_eq!(code(&out), 0, "{shell}: {}", stderr(&out));
        let script = String::from_utf8(out.stdout).unwrap();
        for word in [
            "inspect",
            "verify",
            "consolidate",
            "reshard",
            "max-shard-size",
            "world-size",
        ] {
            assert!(script.contains(word), "{shell}: no `{word}` in\n{script}");
        }
    }
    let env = TestEnv::new();
    let script = env.write(
        "ckpt.bash",
        &ckpt(&[&"generate-shell-completion", &"bash"]).stdout,
    );
    if let Ok(out) = Command::new("bash")
        .arg("-c")
        .arg("source \"$1\" && complete -p ckpt")
        .arg("bash")
        .arg(&script)
        .output()
    {
        let shown = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{}", stderr(&out));
        assert!(shown.contains("ckpt"), "{shown}");
    }
    let bad = ckpt(&[&"generate-shell-completion", &"tcsh"]);
    assert_eq!(code(&bad), 2);
}

/// Run ckpt with its stdout (and with `stderr_too`, its stderr) on a pipe whose read end is
/// already closed, as `ckpt ... | head` (`ckpt ... 2>&1 | head`) is once `head` has what it wants.
fn ckpt_into_closed_pipe(args: &[&dyn AsRef<std::ffi::OsStr>], stderr_too: bool) -> Output {
    use std::os::fd::{FromRawFd, OwnedFd};
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors `pipe` writes.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: `pipe` succeeded, so both descriptors are open and nothing else owns them.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    drop(read);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ckpt"));
    for a in args {
        cmd.arg(a);
    }
    if stderr_too {
        cmd.stderr(std::process::Stdio::from(write.try_clone().unwrap()));
    }
    cmd.stdout(std::process::Stdio::from(write));
    cmd.output().expect("run ckpt")
}

/// Every command, and clap's own output, with stdout a closed pipe (`ckpt ... | head` once `head`
/// has what it wants): the output just ends, with no panic, no broken-pipe message and the exit
/// code the run would have had anyway.
#[test]
fn a_closed_stdout_ends_the_output_without_a_panic() {
    let env = TestEnv::new();
    let dcp = fixtures().join("fsdp2_adamw");
    let single = fixtures().join("single.safetensors");
    // A safetensors file one byte short: `verify` lists the problem, then says NOT sound (exit 1).
    let bytes = std::fs::read(&single).unwrap();
    let short = env.write("short.safetensors", &bytes[..bytes.len() - 1]);
    let manifest = env.path("manifest.json");
    let (cons, cons_torch, split, resh) = (
        env.path("c.safetensors"),
        env.path("c.bin"),
        env.path("split"),
        env.path("resharded"),
    );
    let runs: Vec<(Vec<&dyn AsRef<std::ffi::OsStr>>, i32)> = vec![
        (vec![&"inspect", &dcp], 0),
        (vec![&"inspect", &dcp, &"--json"], 0),
        (vec![&"inspect", &dcp, &"--filter", &"model.*"], 0),
        (vec![&"verify", &dcp], 0),
        (vec![&"verify", &dcp, &"--json"], 0),
        (vec![&"verify", &dcp, &"--deep"], 0),
        (vec![&"verify", &dcp, &"--against", &dcp], 0),
        (vec![&"verify", &dcp, &"--write-manifest", &manifest], 0),
        (vec![&"verify", &dcp, &"--manifest", &manifest], 0),
        (vec![&"verify", &short], 1),
        (vec![&"verify", &short, &"--json"], 1),
        (vec![&"consolidate", &dcp, &"-o", &cons], 0),
        (
            vec![
                &"consolidate",
                &dcp,
                &"-o",
                &cons_torch,
                &"--format",
                &"torch",
            ],
            0,
        ),
        (
            vec![
                &"consolidate",
                &dcp,
                &"-o",
                &split,
                &"--max-shard-size",
                &"1KB",
            ],
            0,
        ),
        (
            vec![&"reshard", &dcp, &"-o", &resh, &"--world-size", &"2"],
            0,
        ),
        (vec![&"--help"], 0),
        (vec![&"--version"], 0),
        (vec![&"help", &"reshard"], 0),
        (vec![&"inspect", &"--help"], 0),
        (vec![&"generate-shell-completion", &"zsh"], 0),
    ];
    for (args, want) in &runs {
        let out = ckpt_into_closed_pipe(args, false);
        let shown: Vec<String> = args
            .iter()
            .map(|a| a.as_ref().to_string_lossy().into_owned())
            .collect();
        let err = stderr(&out);
        assert_eq!(code(&out), *want, "{shown:?}: {err}");
        assert!(!err.contains("panicked"), "{shown:?}: {err}");
        assert!(
            !err.to_lowercase().contains("broken pipe") && !err.contains("os error 32"),
            "{shown:?}: {err}"
        );
    }
}

/// `ckpt ... 2>&1 | head`: messages on stderr (a summary, an error) meet the closed pipe too, and
/// are dropped; the exit code is still the run's (a panic would be 101).
#[test]
fn a_closed_stderr_drops_messages_without_a_panic() {
    let env = TestEnv::new();
    let dcp = fixtures().join("fsdp2_adamw");
    let missing = env.path("missing");
    let bytes = std::fs::read(fixtures().join("single.safetensors")).unwrap();
    let short = env.write("short.safetensors", &bytes[..bytes.len() - 1]);
    let (cons, resh) = (env.path("c.safetensors"), env.path("resharded"));
    let runs: Vec<(Vec<&dyn AsRef<std::ffi::OsStr>>, i32)> = vec![
        (vec![&"inspect", &dcp], 0),
        (vec![&"consolidate", &dcp, &"-o", &cons], 0),
        (
            vec![&"reshard", &dcp, &"-o", &resh, &"--world-size", &"2"],
            0,
        ),
        // An error message, then exit 2 (usage) or 1 (an unreadable input).
        (vec![&"verify", &missing], 2),
        (vec![&"consolidate", &dcp, &"-o", &cons], 2),
        (vec![&"inspect", &short], 1),
        (vec![&"--bogus"], 2),
    ];
    for (args, want) in &runs {
        let out = ckpt_into_closed_pipe(args, true);
        let shown: Vec<String> = args
            .iter()
            .map(|a| a.as_ref().to_string_lossy().into_owned())
            .collect();
        assert_eq!(code(&out), *want, "{shown:?}");
    }
}
