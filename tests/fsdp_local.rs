//! FSDP1 LOCAL_STATE_DICT checkpoints (`fixtures/fsdp_local*`, written by real FSDP1, see
//! `fixtures/generate_fsdp_local.py`) with and without `--shapes-from`. What PyTorch held is
//! `fixtures/expected/fsdp_local*.pt`, a torch.save that ckpt reads as a FULL checkpoint, so
//! `verify --against` compares the logical tensors bit for bit without torch.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

mod common;
use common::{fixtures, TestEnv};

fn ckpt(args: &[&dyn AsRef<std::ffi::OsStr>]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ckpt"));
    for a in args {
        cmd.arg(a);
    }
    cmd.output().expect("run ckpt")
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn references() -> Vec<PathBuf> {
    let r = fixtures().join("fsdp_local_ref");
    vec![r.join("model.pt"), r.join("params.json"), r.join("sharded")]
}

/// (checkpoint, what PyTorch held)
fn locals() -> Vec<(PathBuf, PathBuf)> {
    let f = fixtures();
    vec![
        (f.join("fsdp_local"), f.join("expected/fsdp_local.pt")),
        (
            f.join("fsdp_local_orig"),
            f.join("expected/fsdp_local_orig.pt"),
        ),
    ]
}

#[test]
fn consolidate_with_every_kind_of_reference_gives_the_model() {
    let env = TestEnv::new();
    for (local, expected) in locals() {
        for reference in references() {
            let out = env.path("model.safetensors");
            let run = ckpt(&[
                &"consolidate",
                &local,
                &"-o",
                &out,
                &"--force",
                &"--shapes-from",
                &reference,
            ]);
            assert!(
                run.status.success(),
                "{local:?} {reference:?}: {}",
                text(&run)
            );
            // --against compares names, dtypes, shapes and every byte
            let check = ckpt(&[&"verify", &out, &"--against", &expected]);
            assert!(
                check.status.success(),
                "{local:?} {reference:?}: {}",
                text(&check)
            );
        }
    }
}

#[test]
fn a_tied_weight_comes_out_under_both_names() {
    // `out.weight` is `embed.weight`: one storage in the torch.save reference, flattened once
    let env = TestEnv::new();
    let out = env.path("tied.safetensors");
    let run = ckpt(&[
        &"consolidate",
        &fixtures().join("fsdp_local_tied"),
        &"-o",
        &out,
        &"--shapes-from",
        &fixtures().join("fsdp_local_ref/tied.pt"),
    ]);
    assert!(run.status.success(), "{}", text(&run));
    let expected = fixtures().join("expected/fsdp_local_tied.pt");
    let check = ckpt(&[&"verify", &out, &"--against", &expected]);
    assert!(check.status.success(), "{}", text(&check));
    let doc: Value = serde_json::from_slice(&ckpt(&[&"inspect", &out, &"--json"]).stdout).unwrap();
    let names: Vec<&str> = doc["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["embed.weight", "mid.weight", "mid.bias", "out.weight"]
    );
}

#[test]
fn verify_and_reshard_take_the_reference_too() {
    let env = TestEnv::new();
    let reference = fixtures().join("fsdp_local_ref/model.pt");
    for (local, expected) in locals() {
        let run = ckpt(&[
            &"verify",
            &local,
            &"--deep",
            &"--against",
            &expected,
            &"--shapes-from",
            &reference,
        ]);
        assert!(run.status.success(), "{}", text(&run));
        let out = env.path("resharded");
        let run = ckpt(&[
            &"reshard",
            &local,
            &"-o",
            &out,
            &"--world-size",
            &"3",
            &"--force",
            &"--shapes-from",
            &reference,
        ]);
        assert!(run.status.success(), "{}", text(&run));
        let check = ckpt(&[&"verify", &out, &"--against", &expected]);
        assert!(check.status.success(), "{}", text(&check));
    }
}

#[test]
fn without_shapes_consolidate_refuses_and_says_what_to_pass() {
    let env = TestEnv::new();
    for (local, _) in locals() {
        let run = ckpt(&[&"consolidate", &local, &"-o", &env.path("m.safetensors")]);
        assert_eq!(run.status.code(), Some(2), "{}", text(&run));
        let msg = text(&run);
        assert!(msg.contains("FSDP1 LOCAL_STATE_DICT"), "{msg}");
        assert!(msg.contains("_flat_param"), "{msg}");
        assert!(msg.contains("--shapes-from"), "{msg}");
        assert!(!env.path("m.safetensors").exists());
        let run = ckpt(&[&"verify", &local]);
        assert_eq!(run.status.code(), Some(1), "{}", text(&run));
        assert!(text(&run).contains("--shapes-from"));
    }
}

#[test]
fn inspect_shows_the_flat_params_and_what_is_missing() {
    let out = ckpt(&[&"inspect", &fixtures().join("fsdp_local"), &"--json"]);
    assert!(out.status.success(), "{}", text(&out));
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["state_dict_type"], "LOCAL_STATE_DICT");
    let flat: Vec<&str> = doc["fsdp_local"]["flat_params"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(
        flat,
        [
            "_flat_param",
            "layers.0._flat_param",
            "layers.1._flat_param"
        ]
    );
    assert_eq!(doc["fsdp_local"]["names_and_shapes"], false);
    // 2 + 0 + 35 + 21 + 3 root elements, 9 + 35 + 7 + 7 + 7 per block: odd, so rank 1 is short
    let shapes: Vec<&Value> = doc["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["name"].as_str().unwrap().ends_with("_flat_param"))
        .map(|t| &t["shape"])
        .collect();
    assert_eq!(
        shapes,
        [
            &Value::from(vec![61]),
            &Value::from(vec![65]),
            &Value::from(vec![65])
        ]
    );
    let human = ckpt(&[&"inspect", &fixtures().join("fsdp_local")]);
    let human = text(&human);
    assert!(human.contains("LOCAL_STATE_DICT"), "{human}");
    assert!(
        human.contains("names and shapes are not in the files"),
        "{human}"
    );
    assert!(human.contains("--shapes-from"), "{human}");
    // with the reference: the model's names and shapes
    let out = ckpt(&[
        &"inspect",
        &fixtures().join("fsdp_local_orig"),
        &"--json",
        &"--shapes-from",
        &fixtures().join("fsdp_local_ref/params.json"),
    ]);
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(doc.get("fsdp_local").is_none());
    let lin = doc["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "model.layers.1.lin.weight")
        .unwrap();
    assert_eq!(lin["shape"], Value::from(vec![7, 5]));
}

fn shapes_json(env: &TestEnv, edit: impl Fn(&mut Vec<Value>)) -> PathBuf {
    let text = std::fs::read(fixtures().join("fsdp_local_ref/params.json")).unwrap();
    let mut list: Vec<Value> = serde_json::from_slice(&text).unwrap();
    edit(&mut list);
    env.write("shapes.json", &serde_json::to_vec(&list).unwrap())
}

fn refused(local: &Path, reference: &Path) -> String {
    let out = ckpt(&[
        &"consolidate",
        &local,
        &"-o",
        &Path::new("/nonexistent/never-written.safetensors"),
        &"--shapes-from",
        &reference,
    ]);
    assert!(!out.status.success(), "{}", text(&out));
    text(&out)
}

#[test]
fn wrong_references_are_clear_errors_naming_the_unit() {
    let env = TestEnv::new();
    for (local, _) in locals() {
        // a shape off by one row
        let wrong = shapes_json(&env, |list| {
            for item in list.iter_mut() {
                if item[0] == "layers.1.lin.weight" {
                    item[1] = Value::from(vec![6, 5]);
                }
            }
        });
        let msg = refused(&local, &wrong);
        assert!(msg.contains("layers.1` (`"), "{msg}");
        assert!(!msg.contains("may be buffers"), "{msg}");
        assert!(msg.contains("does not match the flat parameter"), "{msg}");
        // names missing for a whole unit
        let missing = shapes_json(&env, |list| {
            list.retain(|item| !item[0].as_str().unwrap().starts_with("layers.0."))
        });
        let msg = refused(&local, &missing);
        assert!(msg.contains("layers.0` (`"), "{msg}");
        assert!(msg.contains("names no parameter"), "{msg}");
        // not a list of pairs
        let bad = env.write("bad.json", br#"{"embed.weight": [7, 5]}"#);
        let msg = refused(&local, &bad);
        assert!(msg.contains("[name, shape]"), "{msg}");
    }
    // a reference in another dtype: consolidated and cast to bf16 by ckpt itself
    let bf16 = env.path("bf16.pt");
    let run = ckpt(&[
        &"consolidate",
        &fixtures().join("fsdp_local_ref/model.pt"),
        &"-o",
        &bf16,
        &"--dtype",
        &"bf16",
    ]);
    assert!(run.status.success(), "{}", text(&run));
    let msg = refused(&fixtures().join("fsdp_local"), &bf16);
    assert!(msg.contains("FSDP unit `<root>`"), "{msg}");
    assert!(msg.contains("BF16"), "{msg}");
    // alphabetical safetensors headers cannot give the module order
    let st = env.path("ref.safetensors");
    let run = ckpt(&[
        &"consolidate",
        &fixtures().join("fsdp_local_ref/model.pt"),
        &"-o",
        &st,
    ]);
    assert!(run.status.success(), "{}", text(&run));
    let msg = refused(&fixtures().join("fsdp_local"), &st);
    assert!(msg.contains("alphabetically"), "{msg}");
}

#[test]
fn parts_of_a_run_agree_on_the_reference() {
    let env = TestEnv::new();
    let local = fixtures().join("fsdp_local");
    let json = env.path("params.json");
    std::fs::copy(fixtures().join("fsdp_local_ref/params.json"), &json).unwrap();
    let whole = env.path("whole.safetensors");
    let run = ckpt(&[
        &"consolidate",
        &local,
        &"-o",
        &whole,
        &"--shapes-from",
        &json,
    ]);
    assert!(run.status.success(), "{}", text(&run));
    let out = env.path("parts.safetensors");
    let part = |i: &str, reference: &Path| {
        ckpt(&[
            &"consolidate",
            &local,
            &"-o",
            &out,
            &"--part",
            &i,
            &"-q",
            &"--shapes-from",
            &reference,
        ])
    };
    let run = part("0/2", &json);
    assert!(run.status.success(), "{}", text(&run));
    // the same names and shapes, but another file: a part of another run
    let other = env.path("other.json");
    std::fs::copy(&json, &other).unwrap();
    let run = part("1/2", &other);
    assert!(!run.status.success(), "{}", text(&run));
    assert!(text(&run).contains("shapes-from"), "{}", text(&run));
    let run = part("1/2", &json);
    assert!(run.status.success(), "{}", text(&run));
    assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(&whole).unwrap());
}
