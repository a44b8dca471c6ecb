//! Integration tests of `consolidate --hf-config` and `inspect --hf-config` on the real binary:
//! small torchtitan- and Hugging Face-named checkpoints written here (a safetensors file, then
//! resharded by ckpt into a 5-rank DCP so tensors come in pieces), exported to a model
//! directory, and read back with the reference safetensors crate.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::{json, Value};

mod common;
use common::TestEnv;

fn ckpt(args: &[&dyn AsRef<std::ffi::OsStr>]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ckpt"));
    for a in args {
        cmd.arg(a);
    }
    cmd.output().expect("run ckpt")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn ok(out: &Output) {
    assert_eq!(out.status.code(), Some(0), "{}", stderr(out));
}

/// Hidden 8, 2 query heads and 1 KV head of head_dim 6 (not hidden/heads), 2 layers.
const HEADS: u64 = 2;
const KV_HEADS: u64 = 1;
const HEAD_DIM: u64 = 6;

fn config(arch: &str, dtype_field: &str) -> Value {
    json!({
        "architectures": [arch],
        "model_type": "llama",
        "hidden_size": 8,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "num_hidden_layers": 2,
        "intermediate_size": 10,
        "vocab_size": 11,
        "rms_norm_eps": 1e-05,
        dtype_field: "float32",
    })
}

/// A Hugging Face model directory without weights.
fn hf_dir(env: &TestEnv, arch: &str, dtype_field: &str) -> PathBuf {
    let dir = env.path("hf");
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = serde_json::to_vec_pretty(&config(arch, dtype_field)).unwrap();
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    std::fs::write(dir.join("tokenizer.json"), b"{\"version\": \"1.0\"}").unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), b"{}\n").unwrap();
    std::fs::write(dir.join("generation_config.json"), b"{\"do_sample\": true}").unwrap();
    std::fs::write(dir.join("merges.txt"), b"#version: 0.2\n").unwrap();
    // Weights of the original model are not copied.
    std::fs::write(dir.join("model.safetensors"), b"not copied").unwrap();
    dir
}

/// The torchtitan 0.3 names and shapes of the small Llama, with optimizer state beside them.
fn torchtitan_tensors() -> Vec<(String, Vec<u64>)> {
    let mut ts = vec![("tok_embeddings.weight".to_string(), vec![11, 8])];
    for l in 0..2 {
        let p = format!("layers.{l}.");
        for (n, s) in [
            ("attention.qkv_linear.wq.weight", vec![HEADS * HEAD_DIM, 8]),
            (
                "attention.qkv_linear.wk.weight",
                vec![KV_HEADS * HEAD_DIM, 8],
            ),
            (
                "attention.qkv_linear.wv.weight",
                vec![KV_HEADS * HEAD_DIM, 8],
            ),
            ("attention.wo.weight", vec![8, HEADS * HEAD_DIM]),
            ("feed_forward.w1.weight", vec![10, 8]),
            ("feed_forward.w2.weight", vec![8, 10]),
            ("feed_forward.w3.weight", vec![10, 8]),
            ("attention_norm.weight", vec![8]),
            ("ffn_norm.weight", vec![8]),
        ] {
            ts.push((format!("{p}{n}"), s));
        }
    }
    ts.push(("norm.weight".into(), vec![8]));
    ts.push(("lm_head.weight".into(), vec![11, 8]));
    ts.push((
        "optimizer.state.layers.0.attention.wo.weight.exp_avg".into(),
        vec![8, 12],
    ));
    ts
}

/// Element `i` of tensor number `k`: distinct everywhere, so a misplaced row shows.
fn value(k: usize, i: u64) -> f32 {
    (k * 1000) as f32 + i as f32
}

/// A safetensors file of F32 tensors, each element given by [`value`].
fn write_safetensors(path: &Path, tensors: &[(String, Vec<u64>)]) {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (k, (name, shape)) in tensors.iter().enumerate() {
        let n: u64 = shape.iter().product();
        let begin = data.len();
        for i in 0..n {
            data.extend(value(k, i).to_le_bytes());
        }
        header.insert(
            name.clone(),
            json!({"dtype": "F32", "shape": shape, "data_offsets": [begin, data.len()]}),
        );
    }
    let mut text = serde_json::to_vec(&header).unwrap();
    while text.len() % 8 != 0 {
        text.push(b' ');
    }
    let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
    bytes.extend(text);
    bytes.extend(data);
    std::fs::write(path, bytes).unwrap();
}

/// A 5-rank DCP of `tensors` resharded by ckpt from a safetensors file: wq's 12 rows cut
/// every 3, across the RoPE halves.
fn dcp(env: &TestEnv, tensors: &[(String, Vec<u64>)]) -> PathBuf {
    let st = env.path("input.safetensors");
    write_safetensors(&st, tensors);
    let out = env.path("dcp");
    ok(&ckpt(&[
        &"reshard",
        &st,
        &"-o",
        &out,
        &"--world-size",
        &"5",
        &"-q",
    ]));
    out
}

/// Every tensor of a model directory's safetensors files: name → (dtype, shape, bytes).
fn read_model(dir: &Path) -> Vec<(String, String, Vec<usize>, Vec<u8>)> {
    let mut out = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    for f in files {
        let bytes = std::fs::read(&f).unwrap();
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(
            meta.metadata()
                .as_ref()
                .and_then(|m| m.get("format"))
                .map(String::as_str),
            Some("pt"),
            "{}",
            f.display()
        );
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (name, view) in st.tensors() {
            out.push((
                name,
                format!("{:?}", view.dtype()),
                view.shape().to_vec(),
                view.data().to_vec(),
            ));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// torchtitan's row permutation of `k`'s tensor of `heads` heads, as transformers wants it.
fn rope_rows(k: usize, heads: u64, cols: u64) -> Vec<f32> {
    let rows = heads * HEAD_DIM;
    let mut out = Vec::new();
    for r in 0..rows {
        let (h, j, i) = (
            r / HEAD_DIM,
            (r % HEAD_DIM) / (HEAD_DIM / 2),
            r % (HEAD_DIM / 2),
        );
        let src = h * HEAD_DIM + 2 * i + j;
        out.extend((0..cols).map(|c| value(k, src * cols + c)));
    }
    out
}

#[test]
fn a_torchtitan_dcp_becomes_a_model_directory() {
    let env = TestEnv::new();
    let tensors = torchtitan_tensors();
    let input = dcp(&env, &tensors);
    let hf = hf_dir(&env, "LlamaForCausalLM", "torch_dtype");
    let out = env.path("out");
    let run = ckpt(&[&"consolidate", &input, &"-o", &out, &"--hf-config", &hf]);
    ok(&run);
    assert!(
        stderr(&run).contains("left out 1 entries"),
        "{}",
        stderr(&run)
    );

    let model = read_model(&out);
    let names: Vec<&str> = model.iter().map(|m| m.0.as_str()).collect();
    assert_eq!(names.len(), 21);
    assert!(names.contains(&"model.embed_tokens.weight"));
    assert!(names.contains(&"lm_head.weight"));
    assert!(names.iter().all(|n| !n.contains("optimizer")));
    let get = |name: &str| &model.iter().find(|m| m.0 == name).unwrap().3;
    let index = |name: &str| tensors.iter().position(|t| t.0 == name).unwrap();
    // wq and wk rows in transformers' order, wv and the rest as they were.
    for l in 0..2 {
        let q = get(&format!("model.layers.{l}.self_attn.q_proj.weight"));
        let wq = index(&format!("layers.{l}.attention.qkv_linear.wq.weight"));
        assert_eq!(f32s(q), rope_rows(wq, HEADS, 8), "layer {l} q");
        let k = get(&format!("model.layers.{l}.self_attn.k_proj.weight"));
        let wk = index(&format!("layers.{l}.attention.qkv_linear.wk.weight"));
        assert_eq!(f32s(k), rope_rows(wk, KV_HEADS, 8), "layer {l} k");
        let v = get(&format!("model.layers.{l}.self_attn.v_proj.weight"));
        let wv = index(&format!("layers.{l}.attention.qkv_linear.wv.weight"));
        assert_eq!(f32s(v), (0..48).map(|i| value(wv, i)).collect::<Vec<_>>());
    }
    // config.json is the input's with the dtype written; the other files byte for byte.
    let cfg: Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg, config("LlamaForCausalLM", "torch_dtype"));
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "merges.txt",
    ] {
        assert_eq!(
            std::fs::read(out.join(f)).unwrap(),
            std::fs::read(hf.join(f)).unwrap(),
            "{f}"
        );
    }
    let mut listed: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    listed.sort();
    assert_eq!(
        listed,
        [
            "config.json",
            "generation_config.json",
            "merges.txt",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json"
        ]
    );
}

#[test]
fn dtype_split_and_a_config_json_alone() {
    let env = TestEnv::new();
    let input = dcp(&env, &torchtitan_tensors());
    let hf = hf_dir(&env, "LlamaForCausalLM", "dtype");
    let out = env.path("out");
    let run = ckpt(&[
        &"consolidate",
        &input,
        &"-o",
        &out,
        &"--hf-config",
        &hf.join("config.json"),
        &"--dtype",
        &"bf16",
        &"--max-shard-size",
        &"600",
    ]);
    ok(&run);
    let cfg: Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["dtype"], "bfloat16");
    assert!(cfg.get("torch_dtype").is_none());
    assert!(!out.join("tokenizer.json").exists());
    let index: Value =
        serde_json::from_slice(&std::fs::read(out.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    let map = index["weight_map"].as_object().unwrap();
    assert_eq!(map.len(), 21);
    let model = read_model(&out);
    assert_eq!(model.len(), 21);
    assert!(model.iter().all(|m| m.1 == "BF16"));
    for (name, _, _, _) in &model {
        assert!(out.join(map[name].as_str().unwrap()).exists(), "{name}");
    }
}

#[test]
fn hugging_face_names_under_a_prefix_export_as_they_are() {
    let env = TestEnv::new();
    // torchtitan's tensors renamed to transformers' own, under accelerate's `model.` prefix.
    let hf = hf_dir(&env, "LlamaForCausalLM", "torch_dtype");
    let tt = dcp(&env, &torchtitan_tensors());
    let first = env.path("first");
    ok(&ckpt(&[
        &"consolidate",
        &tt,
        &"-o",
        &first,
        &"--hf-config",
        &hf,
        &"-q",
    ]));
    let names: Vec<(String, Vec<u64>)> = read_model(&first)
        .into_iter()
        .map(|(n, _, s, _)| (format!("model.{n}"), s.iter().map(|&d| d as u64).collect()))
        .collect();
    let st = env.path("hf_named.safetensors");
    write_safetensors(&st, &names);
    let out = env.path("out");
    ok(&ckpt(&[
        &"consolidate",
        &st,
        &"-o",
        &out,
        &"--hf-config",
        &hf,
        &"-q",
    ]));
    let model = read_model(&out);
    for (k, (name, _)) in names.iter().enumerate() {
        let m = model
            .iter()
            .find(|m| format!("model.{}", m.0) == *name)
            .unwrap();
        let n: u64 = m.2.iter().map(|&d| d as u64).product();
        assert_eq!(
            f32s(&m.3),
            (0..n).map(|i| value(k, i)).collect::<Vec<_>>(),
            "{name}"
        );
    }
}

#[test]
fn errors_exit_2_and_write_nothing() {
    let env = TestEnv::new();
    let mut tensors = torchtitan_tensors();
    let input = dcp(&env, &tensors);
    let hf = hf_dir(&env, "LlamaForCausalLM", "torch_dtype");
    let cfg_path = hf.join("config.json");
    let out = env.path("out");
    let mut cases: Vec<(Value, &str)> = Vec::new();
    let mut c = config("LlamaForCausalLM", "torch_dtype");
    c["num_key_value_heads"] = json!(2);
    cases.push((c, "`num_key_value_heads` × `head_dim` = 2 × 6 = 12"));
    let mut c = config("LlamaForCausalLM", "torch_dtype");
    c["architectures"] = json!(["MistralForCausalLM"]);
    cases.push((c, "`MistralForCausalLM`"));
    let mut c = config("LlamaForCausalLM", "torch_dtype");
    c["num_hidden_layers"] = json!(3);
    cases.push((c, "model.layers.2."));
    for (cfg, says) in cases {
        std::fs::write(&cfg_path, serde_json::to_vec(&cfg).unwrap()).unwrap();
        let before = env.snapshot();
        let run = ckpt(&[&"consolidate", &input, &"-o", &out, &"--hf-config", &hf]);
        assert_eq!(run.status.code(), Some(2), "{}", stderr(&run));
        assert!(stderr(&run).contains(says), "{says}: {}", stderr(&run));
        assert_eq!(env.snapshot(), before, "{says}");
    }
    // A model tensor the map does not know.
    std::fs::write(
        &cfg_path,
        serde_json::to_vec(&config("LlamaForCausalLM", "torch_dtype")).unwrap(),
    )
    .unwrap();
    tensors.push(("layers.1.attention.sinks".into(), vec![2]));
    let st = env.path("extra.safetensors");
    write_safetensors(&st, &tensors);
    let before = env.snapshot();
    let run = ckpt(&[&"consolidate", &st, &"-o", &out, &"--hf-config", &hf]);
    assert_eq!(run.status.code(), Some(2), "{}", stderr(&run));
    assert!(
        stderr(&run).contains("`layers.1.attention.sinks`"),
        "{}",
        stderr(&run)
    );
    assert!(stderr(&run).contains("--exclude"), "{}", stderr(&run));
    assert_eq!(env.snapshot(), before);
    // ... which --exclude leaves out.
    ok(&ckpt(&[
        &"consolidate",
        &st,
        &"-o",
        &out,
        &"--hf-config",
        &hf,
        &"--exclude",
        &"*.sinks",
        &"-q",
    ]));
}

#[test]
fn inspect_shows_the_mapping_and_what_is_left_out() {
    let env = TestEnv::new();
    let input = dcp(&env, &torchtitan_tensors());
    let hf = hf_dir(&env, "LlamaForCausalLM", "torch_dtype");
    let run = ckpt(&[&"inspect", &input, &"--hf-config", &hf, &"--json"]);
    ok(&run);
    let doc: Value = serde_json::from_slice(&run.stdout).unwrap();
    assert_eq!(doc["architecture"], "LlamaForCausalLM");
    assert_eq!(doc["naming"], "torchtitan");
    assert_eq!(doc["prefix"], "");
    let rows = doc["mapping"].as_array().unwrap();
    assert_eq!(rows.len(), 21);
    assert_eq!(rows[0]["source"], "tok_embeddings.weight");
    assert_eq!(rows[0]["target"], "model.embed_tokens.weight");
    assert_eq!(rows[1]["view"], "rope rows (query heads)");
    let left = doc["left_out"].as_array().unwrap();
    assert_eq!(
        left[0]["name"],
        "optimizer.state.layers.0.attention.wo.weight.exp_avg"
    );
    let run = ckpt(&[&"inspect", &input, &"--hf-config", &hf]);
    ok(&run);
    let text = String::from_utf8(run.stdout).unwrap();
    assert!(text.contains("layers.0.attention.qkv_linear.wq.weight  ->  model.layers.0.self_attn.q_proj.weight  [rope rows (query heads)]"), "{text}");
    assert!(text.contains("training state"), "{text}");
}

#[test]
fn parts_write_the_same_directory_as_one_run() {
    let env = TestEnv::new();
    let input = dcp(&env, &torchtitan_tensors());
    let hf = hf_dir(&env, "LlamaForCausalLM", "torch_dtype");
    let whole = env.path("whole");
    let args = |out: &Path| -> Vec<std::ffi::OsString> {
        let mut a: Vec<std::ffi::OsString> = vec!["consolidate".into(), input.clone().into()];
        a.extend([
            "-o".into(),
            out.into(),
            "--hf-config".into(),
            hf.clone().into(),
        ]);
        a.extend(["--max-shard-size".into(), "900".into(), "-q".into()]);
        a
    };
    let run = |a: &[std::ffi::OsString]| {
        let refs: Vec<&dyn AsRef<std::ffi::OsStr>> =
            a.iter().map(|s| s as &dyn AsRef<std::ffi::OsStr>).collect();
        ckpt(&refs)
    };
    ok(&run(&args(&whole)));
    let parts = env.path("parts");
    for i in [2, 0, 1] {
        let mut a = args(&parts);
        a.extend(["--part".into(), format!("{i}/3").into()]);
        ok(&run(&a));
    }
    let files = |dir: &Path| -> Vec<(String, Vec<u8>)> {
        let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (
                    e.file_name().into_string().unwrap(),
                    std::fs::read(e.path()).unwrap(),
                )
            })
            .collect();
        out.sort();
        out
    };
    let want = files(&whole);
    assert!(
        want.len() > 5,
        "{:?}",
        want.iter().map(|f| &f.0).collect::<Vec<_>>()
    );
    assert_eq!(files(&parts), want);
}

#[test]
fn a_megatron_lm_save_root_is_read_at_the_iteration_it_names() {
    let env = TestEnv::new();
    let root = env.path("checkpoints");
    for iter in ["iter_0000003", "iter_0000007"] {
        common::copy_tree(
            &common::fixtures().join("megatron_torch_dist"),
            &root.join(iter),
        );
    }
    std::fs::write(root.join("latest_checkpointed_iteration.txt"), "7\n").unwrap();
    let names = |args: &[&dyn AsRef<std::ffi::OsStr>]| -> Value {
        let out = ckpt(args);
        ok(&out);
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let latest = names(&[&"inspect", &root, &"--json"]);
    let direct = names(&[&"inspect", &root.join("iter_0000007"), &"--json"]);
    assert_eq!(latest["tensors"], direct["tensors"]);
    assert_eq!(latest["format"], "megatron-torch-dist");
    ok(&ckpt(&[&"inspect", &root, &"--tag", &"3"]));
    ok(&ckpt(&[&"inspect", &root, &"--tag", &"iter_0000003"]));
    let out = ckpt(&[&"inspect", &root, &"--tag", &"4"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("`iter_0000004`"), "{}", stderr(&out));
    std::fs::write(root.join("latest_checkpointed_iteration.txt"), "9").unwrap();
    let out = ckpt(&[&"inspect", &root]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("latest_checkpointed_iteration.txt"),
        "{}",
        stderr(&out)
    );
}
