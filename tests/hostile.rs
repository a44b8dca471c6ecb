//! Hostile inputs: checkpoints crafted to attack ckpt, one test per attack.
//!
//! Each test builds its bad file in code (so it reads as the attack it tries), runs the real binary
//! (`verify`, and `inspect` and `consolidate -o out.safetensors` where they apply) and expects:
//! exit code 1 (101 would be a panic), an error naming the problem, no output under the final name,
//! no temporary left behind, and nothing else in the test's directory created or changed (the
//! payload of a pickle would create a marker file there). Every run has a time limit (a hang is a
//! failure) and an address-space limit (bounded memory is a promise of docs/guarantees.md).
//!
//! A few inputs are legal although they look hostile (tensor names holding `/`, safetensors offsets
//! listed out of order); their tests say so and check that ckpt reads them correctly.
//!
//! `scripts/fuzz` fuzzes the same entry points (fuzz/fuzz_targets); add any crash it finds here
//! as a test with the input's bytes embedded.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ckpt::dtype::DType;
use ckpt::formats::dcp::metadata::{
    self, Chunk, DcpEntry, DcpGlobals, DcpMetadata, MetadataIndex, StorageInfo,
};
use ckpt::model::KeyPart;
use ckpt::zip::{self, ZipRecord};

mod common;
use ckpt::pickle::{self, Limits, Object, Protocol, Value};
use common::{fixtures, TestEnv};

// ---------------------------------------------------------------------------------------------
// Harness
// ---------------------------------------------------------------------------------------------

/// Longest a single ckpt run on a tiny input may take before it counts as a hang.
const RUN_LIMIT: Duration = Duration::from_secs(60);
/// Address space a run may reserve (KiB, for `ulimit -v`): far more than any input here needs.
const MEMORY_LIMIT_KIB: u64 = 4 << 20;

/// What one run of the binary did.
struct Run {
    code: Option<i32>,
    text: String,
    stdout: Vec<u8>,
}

/// Run ckpt with `args` under the time and memory limits.
fn ckpt(args: &[&dyn AsRef<std::ffi::OsStr>]) -> Run {
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(format!("ulimit -v {MEMORY_LIMIT_KIB}; exec \"$0\" \"$@\""))
        .arg(env!("CARGO_BIN_EXE_ckpt"));
    for a in args {
        cmd.arg(a);
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .env("NO_COLOR", "1");
    let mut child = cmd.spawn().expect("run ckpt");
    // Drain the pipes on threads so a chatty child cannot block on a full pipe.
    let mut out_pipe = child.stdout.take().unwrap();
    let mut err_pipe = child.stderr.take().unwrap();
    let out_thread = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out_pipe.read_to_end(&mut v);
        v
    });
    let err_thread = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err_pipe.read_to_end(&mut v);
        v
    });
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > RUN_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            let shown: Vec<String> = args
                .iter()
                .map(|a| a.as_ref().to_string_lossy().into_owned())
                .collect();
            panic!("ckpt {shown:?} hung: still running after {RUN_LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let stdout = out_thread.join().unwrap();
    let stderr = err_thread.join().unwrap();
    let text = String::from_utf8_lossy(&stdout).into_owned() + &String::from_utf8_lossy(&stderr);
    Run {
        code: status.code(),
        text,
        stdout,
    }
}

/// The commands a case runs.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Cmd {
    Verify,
    Inspect,
    Consolidate,
}

/// Every command: for inputs a reader must refuse.
const ALL: &[Cmd] = &[Cmd::Verify, Cmd::Inspect, Cmd::Consolidate];
/// For inputs every reader accepts but that are not sound (bad coverage): `inspect` describes
/// them (its exit code is not checked, only that it does not crash).
const UNSOUND: &[Cmd] = &[Cmd::Verify, Cmd::Consolidate];

fn run_cmd(env: &TestEnv, cmd: Cmd, input: &Path) -> Run {
    match cmd {
        Cmd::Verify => ckpt(&[&"verify", &input]),
        Cmd::Inspect => ckpt(&[&"inspect", &input]),
        Cmd::Consolidate => ckpt(&[
            &"consolidate",
            &input,
            &"-o",
            &env.path("out.safetensors"),
            &"-q",
        ]),
    }
}

/// Assert a run ended by itself (no signal, no panic).
fn assert_no_crash(run: &Run, what: &str) {
    assert_ne!(run.code, Some(101), "{what}: ckpt panicked:\n{}", run.text);
    assert!(
        run.code.is_some(),
        "{what}: ckpt was killed by a signal (abort? out of memory?):\n{}",
        run.text
    );
    assert!(
        !run.text.contains("panicked at"),
        "{what}: panic message:\n{}",
        run.text
    );
}

/// Run `cmds` on `input`; each must exit 1 with a message containing one of `needles`, create no
/// output and leave the temp dir exactly as it was.
fn assert_refused(env: &TestEnv, input: &Path, cmds: &[Cmd], needles: &[&str]) {
    for &cmd in cmds {
        let before = env.snapshot();
        let run = run_cmd(env, cmd, input);
        let what = format!("{cmd:?} {}", input.display());
        assert_no_crash(&run, &what);
        assert_eq!(run.code, Some(1), "{what}: expected exit 1:\n{}", run.text);
        assert!(
            needles.iter().any(|n| run.text.contains(n)),
            "{what}: expected one of {needles:?} in:\n{}",
            run.text
        );
        assert!(
            !env.path("out.safetensors").exists(),
            "{what}: output written"
        );
        assert_eq!(
            env.snapshot(),
            before,
            "{what}: files in the test directory changed"
        );
    }
    if !cmds.contains(&Cmd::Inspect) {
        let run = run_cmd(env, Cmd::Inspect, input);
        assert_no_crash(&run, &format!("inspect {}", input.display()));
    }
}

/// Run verify and expect a sound checkpoint (the benign twin of an attack, proving the builder
/// makes files ckpt reads, so each attack fails for the reason it names).
fn assert_sound(input: &Path) {
    let run = ckpt(&[&"verify", &input, &"--deep"]);
    assert_no_crash(&run, "verify");
    assert_eq!(
        run.code,
        Some(0),
        "{} should be sound:\n{}",
        input.display(),
        run.text
    );
}

fn inspect_json(input: &Path) -> serde_json::Value {
    let run = ckpt(&[&"inspect", &input, &"--json"]);
    assert_no_crash(&run, "inspect");
    assert_eq!(
        run.code,
        Some(0),
        "inspect {}:\n{}",
        input.display(),
        run.text
    );
    serde_json::from_slice(&run.stdout).expect("inspect --json prints JSON")
}

fn tensor_names(input: &Path) -> Vec<String> {
    inspect_json(input)["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap().to_string())
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Pickle opcodes, named as in CPython's `pickle.py`
// ---------------------------------------------------------------------------------------------

const MARK: u8 = b'(';
const STOP: u8 = b'.';
const POP: u8 = b'0';
const DUP: u8 = b'2';
const NONE: u8 = b'N';
const REDUCE: u8 = b'R';
const APPEND: u8 = b'a';
const BUILD: u8 = b'b';
const SETITEM: u8 = b's';
const TUPLE: u8 = b't';
const LIST: u8 = b'l';
const EMPTY_TUPLE: u8 = b')';
const EMPTY_LIST: u8 = b']';
const EMPTY_DICT: u8 = b'}';
const BINGET: u8 = b'h';
const BINPUT: u8 = b'q';
const NEWOBJ: u8 = 0x81;
const TUPLE1: u8 = 0x85;
const TUPLE2: u8 = 0x86;
const LONG4: u8 = 0x8b;
const BINUNICODE: u8 = b'X';
const BINUNICODE8: u8 = 0x8d;
const BINBYTES8: u8 = 0x8e;
const MEMOIZE: u8 = 0x94;

/// A pickle written opcode by opcode.
#[derive(Default)]
struct Pickle(Vec<u8>);

impl Pickle {
    fn proto(n: u8) -> Pickle {
        Pickle(vec![0x80, n])
    }

    fn op(mut self, op: u8) -> Pickle {
        self.0.push(op);
        self
    }

    fn ops(mut self, op: u8, times: usize) -> Pickle {
        self.0.extend(std::iter::repeat_n(op, times));
        self
    }

    fn raw(mut self, bytes: &[u8]) -> Pickle {
        self.0.extend_from_slice(bytes);
        self
    }

    /// `GLOBAL`: `c module\nname\n`, as protocols 0-2 spell it.
    fn global(self, module: &str, name: &str) -> Pickle {
        self.op(b'c').raw(format!("{module}\n{name}\n").as_bytes())
    }

    /// `STACK_GLOBAL` on two strings, as protocol 4 spells it.
    fn stack_global(self, module: &str, name: &str) -> Pickle {
        self.str(module).str(name).op(0x93)
    }

    /// `BINUNICODE`.
    fn str(self, s: &str) -> Pickle {
        self.op(BINUNICODE)
            .raw(&(s.len() as u32).to_le_bytes())
            .raw(s.as_bytes())
    }

    /// `BININT1`.
    fn int(self, i: u8) -> Pickle {
        self.op(b'K').raw(&[i])
    }

    fn stop(self) -> Vec<u8> {
        self.op(STOP).0
    }
}

fn s(v: &str) -> Value {
    Value::Str(v.to_string())
}

fn global(module: &str, name: &str) -> Value {
    Value::global(module, name)
}

/// `callable(*args)`, recorded as `REDUCE` writes it.
fn reduce(callable: Value, args: Vec<Value>) -> Value {
    Value::Object(Box::new(Object {
        callable,
        args,
        new_obj: false,
        dict_items: Vec::new(),
        list_items: Vec::new(),
        state: None,
    }))
}

fn ordered_dict(items: Vec<(Value, Value)>) -> Value {
    Value::Object(Box::new(Object {
        callable: global("collections", "OrderedDict"),
        args: Vec::new(),
        new_obj: false,
        dict_items: items,
        list_items: Vec::new(),
        state: None,
    }))
}

fn ints(v: &[i64]) -> Value {
    Value::Tuple(v.iter().map(|&i| Value::Int(i)).collect())
}

// ---------------------------------------------------------------------------------------------
// Builders: torch.save archives, DCP directories, safetensors files
// ---------------------------------------------------------------------------------------------

/// What `torch._utils._rebuild_tensor_v2` is called with in `data.pkl`.
struct Rebuild<'a> {
    storage_class: &'a str,
    key: &'a str,
    numel: i64,
    offset: i64,
    size: &'a [i64],
    stride: &'a [i64],
}

impl Rebuild<'_> {
    /// An honest contiguous F32 tensor of `n` elements over storage `0`.
    fn f32(size: &[i64]) -> Rebuild<'_> {
        let n = size.iter().product();
        Rebuild {
            storage_class: "FloatStorage",
            key: "0",
            numel: n,
            offset: 0,
            size,
            stride: match size.len() {
                0 => &[],
                1 => &[1],
                _ => panic!("use explicit strides for more dims"),
            },
        }
    }

    fn value(&self) -> Value {
        let storage = Value::PersistentId(Box::new(Value::Tuple(vec![
            s("storage"),
            global("torch", self.storage_class),
            s(self.key),
            s("cpu"),
            Value::Int(self.numel),
        ])));
        reduce(
            global("torch._utils", "_rebuild_tensor_v2"),
            vec![
                storage,
                Value::Int(self.offset),
                ints(self.size),
                ints(self.stride),
                Value::Bool(false),
                ordered_dict(Vec::new()),
            ],
        )
    }
}

/// A torch.save archive (as torch 2.15 lays it out) of `data_pkl` and storage records.
fn torch_save(data_pkl: &[u8], storages: &[(&str, Vec<u8>)]) -> Vec<u8> {
    let literal = |name: &str, content: &[u8]| ZipRecord {
        name: format!("archive/{name}"),
        len: content.len() as u64,
        content: Some(content.to_vec()),
    };
    let mut records = vec![
        literal("data.pkl", data_pkl),
        literal(".format_version", b"1"),
        literal(".storage_alignment", b"64"),
        literal("byteorder", b"little"),
    ];
    for (key, bytes) in storages {
        records.push(literal(&format!("data/{key}"), bytes));
    }
    records.push(literal("version", b"3\n"));
    records.push(literal(".data/serialization_id", &[b'0'; 40]));
    zip::build(&records, &[]).unwrap()
}

/// `f32` values as little-endian bytes.
fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// A `pytorch_model.bin` holding `{name: tensor}` for each `(name, rebuild)`, all over storage `0`
/// of `storage` bytes.
fn torch_save_state_dict(tensors: &[(&str, Value)], storage: Vec<u8>) -> Vec<u8> {
    let sd = ordered_dict(tensors.iter().map(|(n, v)| (s(n), v.clone())).collect());
    torch_save(&pickle::write(&sd, Protocol::V2), &[("0", storage)])
}

/// A one-rank DCP directory holding tensor `w` (F32, shape `[n]`) whose only item is `item`.
fn dcp_with_item(env: &TestEnv, name: &str, n: u64, item: &[u8]) -> PathBuf {
    let dir = env.path(name);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("__0_0.distcp"), item).unwrap();
    let meta = DcpMetadata {
        entries: vec![DcpEntry::Tensor {
            fqn: "w".into(),
            dtype: DType::F32,
            size: vec![n],
            chunks: vec![Chunk {
                offsets: vec![0],
                sizes: vec![n],
            }],
        }],
        storage: vec![(
            MetadataIndex {
                fqn: "w".into(),
                offset: Some(vec![0]),
                index: Some(0),
            },
            StorageInfo {
                relative_path: "__0_0.distcp".into(),
                offset: 0,
                length: item.len() as u64,
                transforms: Vec::new(),
            },
        )],
        planner_data: vec![("w".into(), vec![KeyPart::Key("w".into())])],
        version: Some("1.0.0".into()),
    };
    std::fs::write(dir.join(".metadata"), metadata::write(&meta)).unwrap();
    dir
}

/// A DCP item: `torch.save(tensor)` where the tensor is rebuilt by `rebuild` over `storage`.
fn dcp_item(rebuild: &Rebuild, storage: Vec<u8>) -> Vec<u8> {
    torch_save(
        &pickle::write(&rebuild.value(), Protocol::V2),
        &[(rebuild.key, storage)],
    )
}

/// Copy `fixtures/dtypes` (real PyTorch output) and rewrite its `.metadata` with `f` applied to
/// the parsed metadata.
fn dtypes_with_metadata(env: &TestEnv, f: impl FnOnce(&mut DcpMetadata, &Path)) -> PathBuf {
    let dir = env.copy_fixture("dtypes");
    let path = dir.join(".metadata");
    let mut meta = metadata::parse(&std::fs::read(&path).unwrap()).unwrap();
    f(&mut meta, &dir);
    std::fs::write(&path, metadata::write(&meta)).unwrap();
    dir
}

/// The real `.metadata` of `fixtures/dtypes` as a pickle tree (read with DCP's whitelist).
fn real_metadata_tree() -> Value {
    let bytes = std::fs::read(fixtures().join("dtypes/.metadata")).unwrap();
    pickle::read(&bytes, &DcpGlobals::PLAIN, Limits::default()).unwrap()
}

/// Copy `fixtures/dtypes` and replace its `.metadata` with `bytes`.
fn dtypes_with_metadata_bytes(env: &TestEnv, bytes: &[u8]) -> PathBuf {
    let dir = env.copy_fixture("dtypes");
    std::fs::write(dir.join(".metadata"), bytes).unwrap();
    dir
}

/// Mutable access to the value under string key `key` of a dict, or of an object's state dict.
fn field<'v>(v: &'v mut Value, key: &str) -> &'v mut Value {
    let dict = match v {
        Value::Object(object) => match &mut object.state {
            Some(state) => state,
            None => panic!("not a dict: an object without state"),
        },
        other => other,
    };
    let Value::Dict(items) = dict else {
        panic!("not a dict: {dict:?}")
    };
    items
        .iter_mut()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
        .unwrap_or_else(|| panic!("no key `{key}`"))
}

/// A safetensors file: the 8-byte length of `header`, `header`, then `data_len` zero bytes.
fn safetensors_bytes(header: &str, data_len: usize) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.resize(out.len() + data_len, 0);
    out
}

/// The benign twins, to prove each builder makes files ckpt accepts.
#[test]
fn builders_make_sound_checkpoints() {
    let env = TestEnv::new();
    let st = env.write(
        "ok.safetensors",
        &safetensors_bytes(
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[3],"data_offsets":[8,11]}}"#,
            11,
        ),
    );
    assert_sound(&st);
    assert_sound(&dtypes_with_metadata(&env, |_, _| {}));
    let bin = env.write(
        "ok.bin",
        &torch_save_state_dict(
            &[("w", Rebuild::f32(&[4]).value())],
            f32_bytes(&[1.0, 2.0, 3.0, 4.0]),
        ),
    );
    assert_sound(&bin);
    let item = dcp_item(&Rebuild::f32(&[4]), f32_bytes(&[1.0, 2.0, 3.0, 4.0]));
    assert_sound(&dcp_with_item(&env, "ok_dcp", 4, &item));
}

// ---------------------------------------------------------------------------------------------
// `.metadata` pickles that would run code
// ---------------------------------------------------------------------------------------------

/// Put `payload` in `.metadata` of a copy of `fixtures/dtypes` and check every command refuses it
/// by naming `forbidden`, and that the marker the payload would create does not appear.
fn assert_metadata_refused(env: &TestEnv, payload: &[u8], forbidden: &str) {
    let dir = dtypes_with_metadata_bytes(env, payload);
    assert_refused(env, &dir, ALL, &[forbidden]);
    assert!(!env.path("pwned").exists(), "the payload ran");
}

fn marker(env: &TestEnv) -> String {
    env.path("pwned").display().to_string()
}

#[test]
fn metadata_calling_os_system() {
    let env = TestEnv::new();
    let p = Pickle::proto(2)
        .global("os", "system")
        .str(&format!("touch {}", marker(&env)))
        .op(TUPLE1)
        .op(REDUCE)
        .stop();
    assert_metadata_refused(&env, &p, "os.system");
}

#[test]
fn metadata_calling_posix_system() {
    let env = TestEnv::new();
    let p = Pickle::proto(4)
        .stack_global("posix", "system")
        .str(&format!("touch {}", marker(&env)))
        .op(TUPLE1)
        .op(REDUCE)
        .stop();
    assert_metadata_refused(&env, &p, "posix.system");
}

#[test]
fn metadata_calling_subprocess_popen() {
    let env = TestEnv::new();
    let p = Pickle::proto(2)
        .global("subprocess", "Popen")
        .op(MARK)
        .str("touch")
        .str(&marker(&env))
        .op(LIST)
        .op(TUPLE1)
        .op(REDUCE)
        .stop();
    assert_metadata_refused(&env, &p, "subprocess.Popen");
}

#[test]
fn metadata_calling_builtins_eval() {
    let env = TestEnv::new();
    let p = Pickle::proto(4)
        .stack_global("builtins", "eval")
        .str(&format!("open({:?}, 'w')", marker(&env)))
        .op(TUPLE1)
        .op(REDUCE)
        .stop();
    assert_metadata_refused(&env, &p, "builtins.eval");
}

#[test]
fn metadata_calling_builtins_exec() {
    let env = TestEnv::new();
    let p = Pickle::proto(4)
        .stack_global("builtins", "exec")
        .str(&format!("import os; os.system('touch {}')", marker(&env)))
        .op(TUPLE1)
        .op(REDUCE)
        .stop();
    assert_metadata_refused(&env, &p, "builtins.exec");
}

/// `getattr(importlib.import_module("os"), "system")("touch …")`: the global that comes first in
/// the stream is the one refused.
#[test]
fn metadata_calling_builtins_getattr() {
    let env = TestEnv::new();
    let p = Pickle::proto(4)
        .stack_global("builtins", "getattr")
        .stack_global("importlib", "import_module")
        .str("os")
        .op(TUPLE1)
        .op(REDUCE)
        .str("system")
        .op(TUPLE2)
        .op(REDUCE)
        .str(&format!("touch {}", marker(&env)))
        .op(TUPLE1)
        .op(REDUCE)
        .stop();
    assert_metadata_refused(&env, &p, "builtins.getattr");
}

#[test]
fn metadata_calling_importlib_import_module() {
    let env = TestEnv::new();
    let p = Pickle::proto(4)
        .stack_global("importlib", "import_module")
        .str("os")
        .op(TUPLE1)
        .op(REDUCE)
        .stop();
    assert_metadata_refused(&env, &p, "importlib.import_module");
}

/// `torch.load` of another file would unpickle that file without ckpt's whitelist.
#[test]
fn metadata_calling_torch_load() {
    let env = TestEnv::new();
    let p = Pickle::proto(2)
        .global("torch", "load")
        .str(&env.path("evil.pt").display().to_string())
        .op(TUPLE1)
        .op(REDUCE)
        .stop();
    assert_metadata_refused(&env, &p, "torch.load");
}

/// Python 3's `find_class` walks dotted names at protocol 4: `filesystem` imports `os`, so
/// `(torch.distributed.checkpoint.filesystem, "os.system")` is `os.system`, reached through a
/// whitelisted module.
#[test]
fn metadata_reaching_os_system_through_a_whitelisted_module() {
    let env = TestEnv::new();
    let p = Pickle::proto(4)
        .stack_global("torch.distributed.checkpoint.filesystem", "os.system")
        .str(&format!("touch {}", marker(&env)))
        .op(TUPLE1)
        .op(REDUCE)
        .stop();
    assert_metadata_refused(&env, &p, "os.system");
    // And a whitelisted class with an attribute walk from it.
    let p = Pickle::proto(4)
        .stack_global(
            "torch.distributed.checkpoint.metadata",
            "Metadata.__init__.__globals__",
        )
        .stop();
    assert_metadata_refused(&env, &p, "Metadata.__init__.__globals__");
}

/// The attack hidden deep inside an otherwise real `.metadata`: the `version` string replaced
/// by `posix.system(...)`.
#[test]
fn metadata_real_file_with_a_call_hidden_inside() {
    let env = TestEnv::new();
    let mut tree = real_metadata_tree();
    *field(&mut tree, "version") = reduce(
        global("posix", "system"),
        vec![s(&format!("touch {}", marker(&env)))],
    );
    assert_metadata_refused(&env, &pickle::write(&tree, Protocol::V4), "posix.system");
}

/// The `layout` slot of the first tensor's `TensorProperties` state tuple.
fn first_layout(tree: &mut Value) -> &mut Value {
    let Value::Dict(items) = field(tree, "state_dict_metadata") else {
        panic!("state_dict_metadata is not a dict")
    };
    let tsm = items
        .iter_mut()
        .map(|(_, v)| v)
        .find(|v| v.class().is_some_and(|c| c.1 == "TensorStorageMetadata"))
        .unwrap();
    let Value::Object(object) = field(tsm, "properties") else {
        panic!("properties is not an object")
    };
    let Some(Value::Tuple(items)) = &mut object.state else {
        panic!("TensorProperties state is not a tuple")
    };
    &mut items[1]
}

/// `REDUCE` whose callable is not a global at all (a string naming one): nothing may resolve the
/// name; the structure is simply not DCP metadata.
#[test]
fn metadata_reduce_on_a_non_global_callable() {
    let env = TestEnv::new();
    let p = Pickle::proto(2)
        .str("posix.system")
        .str(&format!("touch {}", marker(&env)))
        .op(TUPLE1)
        .op(REDUCE)
        .stop();
    assert_metadata_refused(&env, &p, "not a DCP `Metadata`");
}

/// Whitelisted callables asked to do something else: `_get_layout` given a name that is not a
/// layout, and the result of a whitelisted call called again.
#[test]
fn metadata_whitelisted_callable_with_a_reduce_that_calls_something_else() {
    let env = TestEnv::new();
    // `_get_layout("os.system")`
    let mut tree = real_metadata_tree();
    *first_layout(&mut tree) = reduce(
        global("torch.serialization", "_get_layout"),
        vec![s("os.system")],
    );
    assert_metadata_refused(&env, &pickle::write(&tree, Protocol::V4), "os.system");

    // `_get_layout("torch.strided")("touch …")`
    let mut tree = real_metadata_tree();
    *first_layout(&mut tree) = reduce(
        reduce(
            global("torch.serialization", "_get_layout"),
            vec![s("torch.strided")],
        ),
        vec![s(&format!("touch {}", marker(&env)))],
    );
    assert_metadata_refused(
        &env,
        &pickle::write(&tree, Protocol::V4),
        "not a torch layout",
    );

    // `torch.Size((posix.system,))`: a whitelisted class whose argument names a forbidden one.
    let mut tree = real_metadata_tree();
    *field(&mut tree, "version") = reduce(
        global("torch", "Size"),
        vec![Value::Tuple(vec![global("posix", "system")])],
    );
    assert_metadata_refused(&env, &pickle::write(&tree, Protocol::V4), "posix.system");

    // `Metadata` built (`BUILD`) with a state made by a forbidden call.
    let p = Pickle::proto(4)
        .stack_global("torch.distributed.checkpoint.metadata", "Metadata")
        .op(EMPTY_TUPLE)
        .op(NEWOBJ)
        .stack_global("builtins", "eval")
        .str("{}")
        .op(TUPLE1)
        .op(REDUCE)
        .op(BUILD)
        .stop();
    assert_metadata_refused(&env, &p, "builtins.eval");
}

// ---------------------------------------------------------------------------------------------
// torch.save `data.pkl`: forbidden globals and lying `_rebuild_tensor_v2` arguments
// ---------------------------------------------------------------------------------------------

/// `data.pkl` that calls `__builtin__.eval` (protocol 2 spelling, read as `builtins.eval`).
fn eval_data_pkl(env: &TestEnv) -> Vec<u8> {
    Pickle::proto(2)
        .global("__builtin__", "eval")
        .str(&format!("open({:?}, 'w')", marker(env)))
        .op(TUPLE1)
        .op(REDUCE)
        .stop()
}

#[test]
fn torch_save_bin_with_a_forbidden_global() {
    let env = TestEnv::new();
    let bin = env.write(
        "pytorch_model.bin",
        &torch_save(&eval_data_pkl(&env), &[("0", f32_bytes(&[1.0]))]),
    );
    assert_refused(&env, &bin, ALL, &["builtins.eval"]);
    assert!(!env.path("pwned").exists());
}

#[test]
fn distcp_item_with_a_forbidden_global() {
    let env = TestEnv::new();
    let item = torch_save(&eval_data_pkl(&env), &[("0", f32_bytes(&[1.0; 4]))]);
    let dir = dcp_with_item(&env, "ckpt", 4, &item);
    assert_refused(&env, &dir, ALL, &["builtins.eval"]);
    assert!(!env.path("pwned").exists());
}

/// A forbidden global nested inside an otherwise real tensor: the rebuild's `backward_hooks`
/// argument made by `posix.system`.
#[test]
fn torch_save_bin_with_a_forbidden_global_inside_a_tensor() {
    let env = TestEnv::new();
    let mut tensor = Rebuild::f32(&[4]).value();
    if let Value::Object(object) = &mut tensor {
        object.args[5] = reduce(
            global("posix", "system"),
            vec![s(&format!("touch {}", marker(&env)))],
        );
    }
    let bin = env.write(
        "pytorch_model.bin",
        &torch_save_state_dict(&[("w", tensor)], f32_bytes(&[0.0; 4])),
    );
    assert_refused(&env, &bin, ALL, &["posix.system"]);
    assert!(!env.path("pwned").exists());
}

/// A per-rank file may name `getattr` only as ShardedTensor's `__getstate__` pickles it,
/// `getattr(ShardedTensor, "ProcessGroupState")`: any other attribute, called or instantiated,
/// is refused (and nothing is ever called).
#[test]
fn per_rank_file_with_getattr_of_another_attribute() {
    let env = TestEnv::new();
    let sharded = global(
        "torch.distributed._shard.sharded_tensor.api",
        "ShardedTensor",
    );
    let getattr = |attr: &str| {
        reduce(
            global("builtins", "getattr"),
            vec![sharded.clone(), s(attr)],
        )
    };
    let called = reduce(getattr("__reduce_ex__"), vec![Value::Int(2)]);
    let made = Value::Object(Box::new(Object {
        callable: getattr("__subclasses__"),
        args: Vec::new(),
        new_obj: true,
        dict_items: Vec::new(),
        list_items: Vec::new(),
        state: None,
    }));
    for (i, value) in [called, made, getattr("__init__")].into_iter().enumerate() {
        let tensor = Rebuild::f32(&[4]).value();
        let pkl = pickle::write(
            &ordered_dict(vec![(s("w"), tensor), (s("x"), value)]),
            Protocol::V2,
        );
        let file = env.write(
            &format!("ranks{i}/rank0.pt"),
            &torch_save(&pkl, &[("0", f32_bytes(&[0.0; 4]))]),
        );
        let needles = ["getattr", "not a class or function"];
        assert_refused(&env, &file, ALL, &needles);
        assert_refused(&env, file.parent().unwrap(), ALL, &needles);
    }
}

/// A world size in a file name can be anything: the missing ranks are counted, a few named, and
/// nothing iterates over (or allocates for) every one of them.
#[test]
fn per_rank_file_naming_a_huge_world_size() {
    let env = TestEnv::new();
    let rank0 = fixtures().join("per_rank_mesh_2x2/model_rank0.pt");
    let file = env.write(
        "huge/model_world_size_99999999999999_rank_0.pt",
        &std::fs::read(rank0).unwrap(),
    );
    assert_refused(&env, file.parent().unwrap(), ALL, &["99999999999998 of"]);
    assert_refused(&env, &file, ALL, &["99999999999998 of"]);
}

/// Words one of which any message about a tensor lying about its storage should contain.
const STORAGE_LIE: &[&str] = &[
    "storage",
    "outside",
    "past the end",
    "beyond",
    "exceed",
    "overflow",
];

/// Check a lying rebuild as a `pytorch_model.bin` entry and as a DCP item.
fn assert_rebuild_refused(rebuild: &Rebuild, storage: Vec<u8>, n: u64, needles: &[&str]) {
    let env = TestEnv::new();
    let bin = env.write(
        "pytorch_model.bin",
        &torch_save_state_dict(&[("w", rebuild.value())], storage.clone()),
    );
    assert_refused(&env, &bin, ALL, needles);
    let dir = dcp_with_item(&env, "ckpt", n, &dcp_item(rebuild, storage));
    assert_refused(&env, &dir, ALL, needles);
}

#[test]
fn rebuild_with_storage_offset_beyond_the_storage() {
    // 4 floats of storage, a 2-element view starting at element 10: it would read the zip framing
    // that follows the record.
    let r = Rebuild {
        offset: 10,
        numel: 4,
        ..Rebuild::f32(&[2])
    };
    assert_rebuild_refused(&r, f32_bytes(&[0.0; 4]), 2, STORAGE_LIE);
}

#[test]
fn rebuild_with_a_shape_beyond_the_storage() {
    let r = Rebuild {
        numel: 4,
        ..Rebuild::f32(&[100])
    };
    assert_rebuild_refused(&r, f32_bytes(&[0.0; 4]), 100, STORAGE_LIE);
}

#[test]
fn rebuild_with_a_storage_numel_larger_than_its_record() {
    // data.pkl says 1000 elements, the record holds 4.
    let r = Rebuild {
        numel: 1000,
        ..Rebuild::f32(&[1000])
    };
    assert_rebuild_refused(&r, f32_bytes(&[0.0; 4]), 1000, STORAGE_LIE);
}

#[test]
fn rebuild_with_negative_sizes() {
    let r = Rebuild::f32(&[-4]);
    assert_rebuild_refused(
        &Rebuild { numel: 4, ..r },
        f32_bytes(&[0.0; 4]),
        4,
        &["negative", "size", "shape"],
    );
}

#[test]
fn rebuild_with_a_negative_storage_offset() {
    let r = Rebuild {
        offset: -1,
        numel: 4,
        ..Rebuild::f32(&[4])
    };
    assert_rebuild_refused(
        &r,
        f32_bytes(&[0.0; 4]),
        4,
        &["negative", "offset", "storage"],
    );
}

#[test]
fn rebuild_with_strides_that_overflow() {
    // 2x2 view with strides 2^62: the last element is at 2^62 + 2^62 elements, 2^65 bytes.
    let r = Rebuild {
        storage_class: "FloatStorage",
        key: "0",
        numel: 4,
        offset: 0,
        size: &[2, 2],
        stride: &[1 << 62, 1 << 62],
    };
    let env = TestEnv::new();
    let bin = env.write(
        "pytorch_model.bin",
        &torch_save_state_dict(&[("w", r.value())], f32_bytes(&[0.0; 4])),
    );
    assert_refused(&env, &bin, ALL, STORAGE_LIE);
    let item = dcp_item(&r, f32_bytes(&[0.0; 4]));
    let dir = env.path("ckpt");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("__0_0.distcp"), &item).unwrap();
    let meta = DcpMetadata {
        entries: vec![DcpEntry::Tensor {
            fqn: "w".into(),
            dtype: DType::F32,
            size: vec![2, 2],
            chunks: vec![Chunk {
                offsets: vec![0, 0],
                sizes: vec![2, 2],
            }],
        }],
        storage: vec![(
            MetadataIndex {
                fqn: "w".into(),
                offset: Some(vec![0, 0]),
                index: Some(0),
            },
            StorageInfo {
                relative_path: "__0_0.distcp".into(),
                offset: 0,
                length: item.len() as u64,
                transforms: Vec::new(),
            },
        )],
        planner_data: Vec::new(),
        version: Some("1.0.0".into()),
    };
    std::fs::write(dir.join(".metadata"), metadata::write(&meta)).unwrap();
    assert_refused(&env, &dir, ALL, STORAGE_LIE);
}

#[test]
fn rebuild_with_negative_strides() {
    let r = Rebuild {
        stride: &[-1],
        numel: 4,
        ..Rebuild::f32(&[4])
    };
    assert_rebuild_refused(&r, f32_bytes(&[0.0; 4]), 4, &["negative", "stride"]);
}

#[test]
fn rebuild_naming_a_storage_record_that_does_not_exist() {
    let r = Rebuild {
        key: "7",
        ..Rebuild::f32(&[4])
    };
    let env = TestEnv::new();
    let sd = ordered_dict(vec![(s("w"), r.value())]);
    let bin = env.write(
        "pytorch_model.bin",
        &torch_save(
            &pickle::write(&sd, Protocol::V2),
            &[("0", f32_bytes(&[0.0; 4]))],
        ),
    );
    assert_refused(&env, &bin, ALL, &["has no record `archive/data/7`"]);
    // A storage key is a record name inside the archive, never a path on disk.
    let r = Rebuild {
        key: "../../../../etc/passwd",
        ..Rebuild::f32(&[4])
    };
    let sd = ordered_dict(vec![(s("w"), r.value())]);
    let bin = env.write(
        "pytorch_model.bin",
        &torch_save(
            &pickle::write(&sd, Protocol::V2),
            &[("0", f32_bytes(&[0.0; 4]))],
        ),
    );
    assert_refused(
        &env,
        &bin,
        ALL,
        &["has no record `archive/data/../../../../etc/passwd`"],
    );
}

#[test]
fn rebuild_with_a_storage_class_that_is_not_a_dtype() {
    let r = Rebuild {
        storage_class: "UntypedStorage.__init__",
        ..Rebuild::f32(&[4])
    };
    let env = TestEnv::new();
    let bin = env.write(
        "pytorch_model.bin",
        &torch_save_state_dict(&[("w", r.value())], f32_bytes(&[0.0; 4])),
    );
    assert_refused(&env, &bin, ALL, &["UntypedStorage.__init__"]);
}

// ---------------------------------------------------------------------------------------------
// Pickle machine abuse, as `.metadata` and as `data.pkl`
// ---------------------------------------------------------------------------------------------

/// Refuse `pickle` both as a DCP `.metadata` and as the `data.pkl` of a `pytorch_model.bin`.
fn assert_pickle_refused(pickle: &[u8], needles: &[&str]) {
    let env = TestEnv::new();
    let dir = dtypes_with_metadata_bytes(&env, pickle);
    assert_refused(&env, &dir, ALL, needles);
    let bin = env.write(
        "pytorch_model.bin",
        &torch_save(pickle, &[("0", f32_bytes(&[0.0; 4]))]),
    );
    assert_refused(&env, &bin, ALL, needles);
}

/// The `.metadata` half of [`assert_pickle_refused`] only (works without the torch.save reader).
fn assert_metadata_pickle_refused(pickle: &[u8], needles: &[&str]) {
    let env = TestEnv::new();
    let dir = dtypes_with_metadata_bytes(&env, pickle);
    assert_refused(&env, &dir, ALL, needles);
}

const PICKLE_LIMIT: &[&str] = &["safety limit", "too deep", "nest", "limit"];

#[test]
fn pickle_nesting_100k_lists_deep() {
    // 100k empty lists, then 100k APPENDs each putting the top list into the one below.
    let p = Pickle::proto(2)
        .ops(EMPTY_LIST, 100_001)
        .ops(APPEND, 100_000)
        .stop();
    assert_metadata_pickle_refused(&p, PICKLE_LIMIT);
    assert_pickle_refused(&p, PICKLE_LIMIT);
}

#[test]
fn pickle_nesting_100k_tuples_deep() {
    let p = Pickle::proto(2).op(EMPTY_TUPLE).ops(TUPLE1, 100_000).stop();
    assert_metadata_pickle_refused(&p, PICKLE_LIMIT);
    assert_pickle_refused(&p, PICKLE_LIMIT);
}

#[test]
fn pickle_nesting_100k_marks_deep() {
    // MARK x 100k, then LIST x 100k: each LIST wraps the previous list.
    let p = Pickle::proto(2)
        .ops(MARK, 100_000)
        .ops(LIST, 100_000)
        .stop();
    assert_metadata_pickle_refused(&p, PICKLE_LIMIT);
    assert_pickle_refused(&p, PICKLE_LIMIT);
}

#[test]
fn pickle_nesting_100k_dicts_deep() {
    // {0: {0: {0: ...}}}: EMPTY_DICT, key, then the next level; SETITEM closes them from the inside.
    let mut p = Pickle::proto(2);
    for _ in 0..100_000 {
        p = p.op(EMPTY_DICT).int(0);
    }
    let p = p.op(NONE).ops(SETITEM, 100_000).stop();
    assert_metadata_pickle_refused(&p, PICKLE_LIMIT);
    assert_pickle_refused(&p, PICKLE_LIMIT);
}

#[test]
fn pickle_billion_laughs_by_memo() {
    // Level 0 is an int; each level is a list of ten BINGETs of the level below: 10^9 leaves.
    let mut p = Pickle::proto(2).int(0).op(BINPUT).raw(&[0]);
    for level in 0u8..9 {
        p = p.op(MARK);
        for _ in 0..10 {
            p = p.op(BINGET).raw(&[level]);
        }
        p = p.op(LIST).op(BINPUT).raw(&[level + 1]);
    }
    let p = p.stop();
    assert_metadata_pickle_refused(&p, PICKLE_LIMIT);
    assert_pickle_refused(&p, PICKLE_LIMIT);
}

#[test]
fn pickle_billion_laughs_by_dup() {
    // x; (x, x); ((x, x), (x, x)); ... 64 times: 2^64 leaves in 130 bytes.
    let mut p = Pickle::proto(2).op(NONE);
    for _ in 0..64 {
        p = p.op(DUP).op(TUPLE2);
    }
    let p = p.stop();
    assert_metadata_pickle_refused(&p, PICKLE_LIMIT);
    assert_pickle_refused(&p, PICKLE_LIMIT);
}

#[test]
fn pickle_billion_laughs_of_ever_growing_memoized_lists() {
    // l = [l0]; l = l + [l, l] each step via MEMOIZE/BINGET: every level references the two
    // previous ones (Fibonacci growth), 200 levels.
    let mut p = Pickle::proto(4)
        .op(EMPTY_LIST)
        .op(MEMOIZE)
        .op(EMPTY_LIST)
        .op(MEMOIZE);
    for level in 2u32..200 {
        p = p
            .op(MARK)
            .op(b'j')
            .raw(&(level - 1).to_le_bytes())
            .op(b'j')
            .raw(&(level - 2).to_le_bytes())
            .op(LIST)
            .op(MEMOIZE)
            .op(POP);
    }
    let p = p.op(b'j').raw(&199u32.to_le_bytes()).stop();
    assert_metadata_pickle_refused(&p, PICKLE_LIMIT);
    assert_pickle_refused(&p, PICKLE_LIMIT);
}

const TRUNCATED: &[&str] = &["ends early", "truncated", "past the end"];

#[test]
fn pickle_long4_declaring_2_gib() {
    let p = Pickle::proto(2)
        .op(LONG4)
        .raw(&0x7fff_ffffu32.to_le_bytes())
        .raw(&[1, 2, 3])
        .stop();
    assert_metadata_pickle_refused(&p, TRUNCATED);
    assert_pickle_refused(&p, TRUNCATED);
}

#[test]
fn pickle_long4_of_a_megabyte() {
    // A real 8-Mbit integer: present in full, far beyond 64 bits. Python reads it, and so does
    // ckpt (as its bytes, without arithmetic); it is still no `Metadata`.
    let mut digits = vec![0xffu8; 1 << 20];
    digits[0] = 1;
    *digits.last_mut().unwrap() = 0x7f;
    let p = Pickle::proto(2)
        .op(LONG4)
        .raw(&(digits.len() as u32).to_le_bytes())
        .raw(&digits)
        .stop();
    assert_metadata_pickle_refused(&p, &["not a `Metadata`", "Metadata"]);
}

#[test]
fn pickle_binunicode8_declaring_2_pow_63_bytes() {
    let p = Pickle::proto(4)
        .op(BINUNICODE8)
        .raw(&(1u64 << 63).to_le_bytes())
        .raw(b"abc")
        .stop();
    assert_metadata_pickle_refused(&p, TRUNCATED);
    assert_pickle_refused(&p, TRUNCATED);
}

#[test]
fn pickle_binbytes8_and_binunicode_declaring_huge_lengths() {
    for p in [
        Pickle::proto(4)
            .op(BINBYTES8)
            .raw(&u64::MAX.to_le_bytes())
            .stop(),
        Pickle::proto(4)
            .op(BINUNICODE)
            .raw(&u32::MAX.to_le_bytes())
            .stop(),
        Pickle::proto(4)
            .op(0x96)
            .raw(&(u64::MAX - 8).to_le_bytes())
            .stop(),
    ] {
        assert_metadata_pickle_refused(&p, TRUNCATED);
    }
}

#[test]
fn pickle_mark_without_end() {
    // Two million open marks: more than the stack limit.
    let p = Pickle::proto(2).ops(MARK, 2_000_000).stop();
    assert_metadata_pickle_refused(&p, &["mark", "limit", "malformed"]);
    // A mark never closed before STOP, with nothing after it.
    let p = Pickle::proto(2).op(NONE).op(MARK).stop();
    assert_metadata_pickle_refused(&p, &["malformed", "underflow", "mark", "empty"]);
    // A mark never closed, with a value after it (Python returns the value; it is no metadata).
    let p = Pickle::proto(2).ops(MARK, 1000).op(NONE).stop();
    assert_metadata_pickle_refused(&p, &["malformed", "mark", "not a DCP `Metadata`"]);
}

#[test]
fn pickle_stack_underflow() {
    for (i, ops) in [
        &[STOP][..],
        &[POP, STOP],
        &[TUPLE, STOP],
        &[REDUCE, STOP],
        &[NONE, REDUCE, STOP],
        &[NONE, SETITEM, STOP],
        &[NONE, NONE, SETITEM, STOP],
        &[APPEND, STOP],
        &[NONE, BUILD, STOP],
        &[TUPLE1, STOP],
        &[NONE, TUPLE2, STOP],
        &[NEWOBJ, STOP],
        &[BINGET, 9, STOP],
        &[MARK, TUPLE1, STOP],
        &[b'Q', STOP],
    ]
    .iter()
    .enumerate()
    {
        let p = Pickle::proto(2).raw(ops).0;
        let env = TestEnv::new();
        let dir = dtypes_with_metadata_bytes(&env, &p);
        let run = ckpt(&[&"verify", &dir]);
        assert_no_crash(&run, &format!("underflow case {i} {ops:?}"));
        assert_eq!(run.code, Some(1), "case {i} {ops:?}: {}", run.text);
        assert!(
            run.text.contains("pickle"),
            "case {i} {ops:?}: {}",
            run.text
        );
    }
}

#[test]
fn pickle_truncated_everywhere() {
    // Every prefix of the real `.metadata` (stepping through it) is refused without a crash.
    let real = std::fs::read(fixtures().join("dtypes/.metadata")).unwrap();
    let env = TestEnv::new();
    let dir = env.copy_fixture("dtypes");
    for end in (0..real.len()).step_by(997) {
        std::fs::write(dir.join(".metadata"), &real[..end]).unwrap();
        let run = ckpt(&[&"verify", &dir]);
        assert_no_crash(&run, &format!("prefix {end}"));
        assert_eq!(run.code, Some(1), "prefix of {end} bytes: {}", run.text);
    }
}

// ---------------------------------------------------------------------------------------------
// safetensors headers
// ---------------------------------------------------------------------------------------------

fn st_case(header_len: u64, rest: &[u8]) -> Vec<u8> {
    let mut out = header_len.to_le_bytes().to_vec();
    out.extend_from_slice(rest);
    out
}

#[test]
fn safetensors_header_length_2_pow_63() {
    let env = TestEnv::new();
    let f = env.write("model.safetensors", &st_case(1 << 63, b"{}"));
    assert_refused(
        &env,
        &f,
        ALL,
        &["header length 9223372036854775808 exceeds"],
    );
    let f = env.write("model.safetensors", &st_case(u64::MAX, b"{}"));
    assert_refused(&env, &f, ALL, &["exceeds"]);
}

#[test]
fn safetensors_header_longer_than_the_file() {
    let env = TestEnv::new();
    let f = env.write("model.safetensors", &st_case(1000, b"{\"a\":1}"));
    assert_refused(&env, &f, ALL, &["runs past the end of the file"]);
}

#[test]
fn safetensors_overlapping_data_offsets() {
    let env = TestEnv::new();
    let h = r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}}"#;
    let f = env.write("model.safetensors", &safetensors_bytes(h, 24));
    assert_refused(&env, &f, ALL, &["overlap"]);
    // Two tensors on the very same bytes (aliasing).
    let h = r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
    let f = env.write("model.safetensors", &safetensors_bytes(h, 16));
    assert_refused(&env, &f, ALL, &["overlap"]);
}

/// Offsets listed out of order but tiling the buffer are legal (the `safetensors` crate sorts
/// them before checking): ckpt must read each tensor from its own bytes.
#[test]
fn safetensors_unordered_offsets_are_legal_and_read_correctly() {
    let env = TestEnv::new();
    let h = r#"{"second":{"dtype":"F32","shape":[2],"data_offsets":[8,16]},"first":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
    let mut bytes = safetensors_bytes(h, 0);
    bytes.extend(f32_bytes(&[1.0, 2.0, 3.0, 4.0]));
    let f = env.write("model.safetensors", &bytes);
    assert_sound(&f);
    let out = env.path("out.safetensors");
    let run = ckpt(&[&"consolidate", &f, &"-o", &out, &"-q"]);
    assert_eq!(run.code, Some(0), "{}", run.text);
    let header = ckpt::formats::safetensors::read_header(&out).unwrap();
    let data = std::fs::read(&out).unwrap();
    for (name, want) in [("first", [1.0f32, 2.0]), ("second", [3.0, 4.0])] {
        let t = header.tensors.iter().find(|t| t.name == name).unwrap();
        let at = (header.data_start + t.begin) as usize;
        assert_eq!(&data[at..at + 8], &f32_bytes(&want)[..], "{name}");
    }
    // An entry whose end comes before its begin is not a range at all.
    let h = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}}"#;
    let f = env.write("bad.safetensors", &safetensors_bytes(h, 8));
    std::fs::remove_file(&out).unwrap();
    assert_refused(&env, &f, ALL, &["end before they begin"]);
}

#[test]
fn safetensors_offsets_beyond_the_file() {
    let env = TestEnv::new();
    let h = r#"{"a":{"dtype":"U8","shape":[1099511627776],"data_offsets":[0,1099511627776]}}"#;
    let f = env.write("model.safetensors", &safetensors_bytes(h, 16));
    assert_refused(&env, &f, ALL, &["bytes missing"]);
    // End at 2^64 - 1 with a begin that makes the size match: data_start + end overflows.
    let h = r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[18446744073709551614,18446744073709551615]}}"#;
    let f = env.write("model.safetensors", &safetensors_bytes(h, 16));
    assert_refused(&env, &f, ALL, &["belong to no tensor", "overflow"]);
}

#[test]
fn safetensors_shape_whose_product_overflows_u64() {
    let env = TestEnv::new();
    let h = r#"{"a":{"dtype":"F32","shape":[4294967296,4294967296,2],"data_offsets":[0,0]}}"#;
    let f = env.write("model.safetensors", &safetensors_bytes(h, 0));
    assert_refused(&env, &f, ALL, &["more than 2^64"]);
    // The element count fits, the byte count does not.
    let h = r#"{"a":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,0]}}"#;
    let f = env.write("model.safetensors", &safetensors_bytes(h, 0));
    assert_refused(&env, &f, ALL, &["more than 2^64"]);
}

#[test]
fn safetensors_unknown_dtype() {
    let env = TestEnv::new();
    let h = r#"{"a":{"dtype":"Q7","shape":[1],"data_offsets":[0,1]}}"#;
    let f = env.write("model.safetensors", &safetensors_bytes(h, 1));
    assert_refused(&env, &f, ALL, &["unknown dtype `Q7`"]);
}

#[test]
fn safetensors_duplicate_names() {
    let env = TestEnv::new();
    let h = r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#;
    let f = env.write("model.safetensors", &safetensors_bytes(h, 2));
    assert_refused(&env, &f, ALL, &["twice"]);
}

/// A tensor name with `/` is legal in safetensors (and common: `model/layer/w` from TF ports).
/// Tensor names never become paths, so it is read, consolidated and resharded as a name, and no
/// directory appears.
#[test]
fn safetensors_names_with_slashes_are_legal_names_not_paths() {
    let env = TestEnv::new();
    let names = ["enc/layer.0/w", "../../escaped", "/abs/name", "a\\b"];
    let header = ckpt::formats::safetensors::header_bytes(
        &names
            .iter()
            .map(|n| (n.to_string(), DType::U8, vec![2]))
            .collect::<Vec<_>>(),
        &[],
    );
    let mut bytes = header.0;
    bytes.extend((0..names.len() * 2).map(|i| i as u8));
    let input = env.write("in/model.safetensors", &bytes);
    assert_sound(&input);
    let mut got = tensor_names(&input);
    got.sort();
    let mut want: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    want.sort();
    assert_eq!(got, want);
    let before = env.snapshot();
    let out = env.path("out/model.safetensors");
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    let run = ckpt(&[&"consolidate", &input, &"-o", &out, &"-q"]);
    assert_eq!(run.code, Some(0), "{}", run.text);
    let mut got = tensor_names(&out);
    got.sort();
    assert_eq!(got, want);
    for format in ["dcp", "dcp-safetensors"] {
        let out_dir = env.path(&format!("sharded-{format}"));
        let run = ckpt(&[
            &"reshard",
            &input,
            &"-o",
            &out_dir,
            &"--world-size",
            &"2",
            &"--format",
            &format,
            &"-q",
        ]);
        assert_eq!(run.code, Some(0), "{format}: {}", run.text);
        let mut got = tensor_names(&out_dir);
        got.sort();
        assert_eq!(got, want, "{format}");
        for e in std::fs::read_dir(&out_dir).unwrap() {
            assert!(
                e.unwrap().path().is_file(),
                "{format}: a directory appeared in the output"
            );
        }
    }
    // Nothing appeared but the outputs.
    let after = env.snapshot();
    let new: Vec<&PathBuf> = after.keys().filter(|p| !before.contains_key(*p)).collect();
    for p in new {
        let rel = p.strip_prefix(env.root()).unwrap();
        assert!(
            rel.starts_with("out")
                || rel.starts_with("sharded-dcp")
                || rel.starts_with("sharded-dcp-safetensors"),
            "unexpected file {}",
            p.display()
        );
    }
    assert!(!env.path("escaped").exists() && !Path::new("/abs/name").exists());
}

/// A tensor name holding NUL is a legal JSON string and harmless (names never become paths);
/// ckpt accepts it and keeps it byte for byte (escaped as `\u0000` in JSON output).
#[test]
fn safetensors_names_with_nul_are_kept_exactly() {
    let env = TestEnv::new();
    let h = r#"{"a\u0000b":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#;
    let input = env.write("model.safetensors", &safetensors_bytes(h, 1));
    assert_sound(&input);
    assert_eq!(tensor_names(&input), vec!["a\0b".to_string()]);
    let out = env.path("out.safetensors");
    let run = ckpt(&[&"consolidate", &input, &"-o", &out, &"-q"]);
    assert_eq!(run.code, Some(0), "{}", run.text);
    assert_eq!(tensor_names(&out), vec!["a\0b".to_string()]);
    let out_dir = env.path("sharded");
    let run = ckpt(&[
        &"reshard",
        &input,
        &"-o",
        &out_dir,
        &"--world-size",
        &"2",
        &"-q",
    ]);
    assert_eq!(run.code, Some(0), "{}", run.text);
    assert_eq!(tensor_names(&out_dir), vec!["a\0b".to_string()]);
}

#[test]
fn safetensors_header_that_is_not_an_object_or_not_utf8() {
    let env = TestEnv::new();
    for (i, header) in [
        &b"[1,2,3]"[..],
        b"\xff\xfe{}",
        b"{\"a\":\"x\"}",
        b"{\"a\":{\"dtype\":\"U8\",\"shape\":[-1],\"data_offsets\":[0,1]}}",
        b"{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0]}}",
        b"{\"__metadata__\":{\"k\":1}}",
        b"{\"a\":{\"dtype\":\"U8\",\"shape\":[1.5],\"data_offsets\":[0,1]}}",
    ]
    .iter()
    .enumerate()
    {
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header);
        bytes.push(0);
        let f = env.write(&format!("bad{i}.safetensors"), &bytes);
        assert_refused(
            &env,
            &f,
            &[Cmd::Verify],
            &["header", "shape", "data_offsets", "`a`", "JSON"],
        );
    }
}

// ---------------------------------------------------------------------------------------------
// ZIP archives (as `pytorch_model.bin`)
// ---------------------------------------------------------------------------------------------

/// A ZIP assembled by hand: local headers (sizes inline, no descriptor) and a central directory
/// whose fields the test may falsify.
#[derive(Default)]
struct HandZip {
    bytes: Vec<u8>,
    central: Vec<HandEntry>,
}

#[derive(Clone)]
struct HandEntry {
    name: String,
    local_offset: u64,
    size: u64,
    crc: u32,
    method: u16,
}

fn local_header(name: &str, data: &[u8], method: u16) -> Vec<u8> {
    let mut h = Vec::new();
    h.extend_from_slice(&0x0403_4b50u32.to_le_bytes());
    h.extend_from_slice(&20u16.to_le_bytes()); // version needed
    h.extend_from_slice(&0x0800u16.to_le_bytes()); // UTF-8 names
    h.extend_from_slice(&method.to_le_bytes());
    h.extend_from_slice(&[0; 4]); // time, date
    h.extend_from_slice(&crc32fast::hash(data).to_le_bytes());
    h.extend_from_slice(&(data.len() as u32).to_le_bytes());
    h.extend_from_slice(&(data.len() as u32).to_le_bytes());
    h.extend_from_slice(&(name.len() as u16).to_le_bytes());
    h.extend_from_slice(&0u16.to_le_bytes());
    h.extend_from_slice(name.as_bytes());
    h
}

impl HandZip {
    /// Append a local header and `data`; record the central entry.
    fn entry(&mut self, name: &str, data: &[u8], method: u16) -> &mut HandEntry {
        let local_offset = self.bytes.len() as u64;
        self.bytes.extend(local_header(name, data, method));
        self.bytes.extend_from_slice(data);
        self.central.push(HandEntry {
            name: name.into(),
            local_offset,
            size: data.len() as u64,
            crc: crc32fast::hash(data),
            method,
        });
        self.central.last_mut().unwrap()
    }

    fn central_bytes(&self) -> Vec<u8> {
        let mut cd = Vec::new();
        for e in &self.central {
            cd.extend_from_slice(&0x0201_4b50u32.to_le_bytes());
            cd.extend_from_slice(&20u16.to_le_bytes()); // made by
            cd.extend_from_slice(&20u16.to_le_bytes()); // needed
            cd.extend_from_slice(&0x0800u16.to_le_bytes());
            cd.extend_from_slice(&e.method.to_le_bytes());
            cd.extend_from_slice(&[0; 4]);
            cd.extend_from_slice(&e.crc.to_le_bytes());
            cd.extend_from_slice(&(e.size.min(0xffff_ffff) as u32).to_le_bytes());
            cd.extend_from_slice(&(e.size.min(0xffff_ffff) as u32).to_le_bytes());
            cd.extend_from_slice(&(e.name.len() as u16).to_le_bytes());
            cd.extend_from_slice(&[0; 4]); // extra, comment lengths
            cd.extend_from_slice(&[0; 8]); // disk, attributes
            cd.extend_from_slice(&(e.local_offset.min(0xffff_ffff) as u32).to_le_bytes());
            cd.extend_from_slice(e.name.as_bytes());
        }
        cd
    }

    /// The archive with a classic end record announcing `count` entries (or the real count).
    fn finish(&self, count: Option<u16>) -> Vec<u8> {
        let mut out = self.bytes.clone();
        let cd = self.central_bytes();
        let cd_offset = out.len() as u32;
        out.extend_from_slice(&cd);
        let n = count.unwrap_or(self.central.len() as u16);
        out.extend_from_slice(&0x0605_4b50u32.to_le_bytes());
        out.extend_from_slice(&[0; 4]); // disks
        out.extend_from_slice(&n.to_le_bytes());
        out.extend_from_slice(&n.to_le_bytes());
        out.extend_from_slice(&(cd.len() as u32).to_le_bytes());
        out.extend_from_slice(&cd_offset.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out
    }

    /// The archive with a zip64 end record and locator holding the given values, and a classic
    /// end record saturated as miniz writes it.
    fn finish_zip64(
        &self,
        entries: u64,
        cd_size: u64,
        cd_offset: u64,
        eocd64_at: Option<u64>,
    ) -> Vec<u8> {
        let mut out = self.bytes.clone();
        out.extend_from_slice(&self.central_bytes());
        let at = out.len() as u64;
        out.extend_from_slice(&0x0606_4b50u32.to_le_bytes());
        out.extend_from_slice(&44u64.to_le_bytes());
        out.extend_from_slice(&0x031eu16.to_le_bytes());
        out.extend_from_slice(&0x002du16.to_le_bytes());
        out.extend_from_slice(&[0; 8]); // disks
        out.extend_from_slice(&entries.to_le_bytes());
        out.extend_from_slice(&entries.to_le_bytes());
        out.extend_from_slice(&cd_size.to_le_bytes());
        out.extend_from_slice(&cd_offset.to_le_bytes());
        out.extend_from_slice(&0x0706_4b50u32.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&eocd64_at.unwrap_or(at).to_le_bytes());
        out.extend_from_slice(&1u32.to_le_bytes());
        out.extend_from_slice(&0x0605_4b50u32.to_le_bytes());
        out.extend_from_slice(&[0; 4]);
        out.extend_from_slice(&[0xff; 4]); // entries
        out.extend_from_slice(&[0xff; 8]); // size, offset
        out.extend_from_slice(&0u16.to_le_bytes());
        out
    }
}

/// A valid torch.save archive written by hand: the records of a one-tensor state dict.
fn hand_archive() -> HandZip {
    let sd = ordered_dict(vec![(s("w"), Rebuild::f32(&[4]).value())]);
    let mut z = HandZip::default();
    z.entry("archive/data.pkl", &pickle::write(&sd, Protocol::V2), 0);
    z.entry("archive/byteorder", b"little", 0);
    z.entry("archive/data/0", &f32_bytes(&[1.0, 2.0, 3.0, 4.0]), 0);
    z.entry("archive/version", b"3\n", 0);
    z
}

/// Every command must refuse `bytes` as a `pytorch_model.bin` with `needle` (a record's content is
/// checked by the torch.save reader, not by the ZIP reader).
fn assert_bin_refused(bytes: &[u8], needle: &str) {
    let env = TestEnv::new();
    let bin = env.write("pytorch_model.bin", bytes);
    assert_refused(&env, &bin, ALL, &[needle]);
}

/// The ZIP reader must refuse `bytes` with `needle` (checked on the library call, which works
/// without the torch.save reader), and so must every command on it as a `pytorch_model.bin`.
fn assert_zip_refused(bytes: &[u8], needle: &str) {
    let err = zip::read_entries(bytes)
        .expect_err("zip accepted")
        .to_string();
    assert!(err.contains(needle), "expected `{needle}` in: {err}");
    let env = TestEnv::new();
    let bin = env.write("pytorch_model.bin", bytes);
    assert_refused(&env, &bin, ALL, &[needle]);
}

#[test]
fn zip_hand_built_archive_is_read() {
    let bytes = hand_archive().finish(None);
    assert_eq!(zip::read_entries(&bytes).unwrap().len(), 4);
    let env = TestEnv::new();
    assert_sound(&env.write("pytorch_model.bin", &bytes));
}

/// The hand-built archive with `data/0` replaced by `data` under `method` (both its sizes
/// `data.len()`, its CRC that of `data`).
fn with_data_0(data: &[u8], method: u16) -> Vec<u8> {
    let mut z = hand_archive();
    let mut fresh = HandZip::default();
    for e in z.central.drain(..) {
        let start = e.local_offset as usize + 30 + e.name.len();
        let old = z.bytes[start..start + e.size as usize].to_vec();
        if e.name == "archive/data/0" {
            fresh.entry(&e.name, data, method);
        } else {
            fresh.entry(&e.name, &old, 0);
        }
    }
    fresh.finish(None)
}

#[test]
fn zip_entry_of_a_method_torch_cannot_read() {
    assert_zip_refused(
        &with_data_0(&f32_bytes(&[1.0, 2.0, 3.0, 4.0]), 12),
        "method 12",
    );
}

#[test]
fn zip_deflate_bomb_stops_at_the_declared_length() {
    // 256 MiB of zeros deflate to about 256 KiB; the headers say 256 KiB (the stream's length) both
    // ways, so inflating must stop one byte past it rather than fill memory.
    use std::io::Write;
    let mut enc = flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::best());
    let zeros = vec![0u8; 1 << 20];
    for _ in 0..256 {
        enc.write_all(&zeros).unwrap();
    }
    let bomb = enc.finish().unwrap();
    assert_bin_refused(&with_data_0(&bomb, 8), "or more");
}

#[test]
fn zip_deflated_entry_with_a_wrong_size() {
    let mut z = hand_archive();
    // `data/0` deflated (a stored-block deflate stream: valid deflate that happens to be stored).
    let raw = f32_bytes(&[1.0, 2.0, 3.0, 4.0]);
    let mut deflated = vec![0x01, raw.len() as u8, 0, !(raw.len() as u8), 0xff];
    deflated.extend_from_slice(&raw);
    let mut fresh = HandZip::default();
    for e in z.central.drain(..) {
        let start = e.local_offset as usize + 30 + e.name.len();
        let data = z.bytes[start..start + e.size as usize].to_vec();
        if e.name == "archive/data/0" {
            fresh.entry(&e.name, &deflated, 8);
        } else {
            fresh.entry(&e.name, &data, 0);
        }
    }
    // The headers give the deflated length as the inflated one too: 5 bytes short of it.
    assert_bin_refused(
        &fresh.finish(None),
        "inflates to 16 bytes, but its header says 21",
    );
}

#[test]
fn zip_overlapping_entries() {
    // `data/0`'s bytes contain a whole second entry (`data/1`): two records share bytes.
    let mut z = HandZip::default();
    let sd = ordered_dict(vec![
        (s("a"), Rebuild::f32(&[16]).value()),
        (
            s("b"),
            Rebuild {
                key: "1",
                ..Rebuild::f32(&[1])
            }
            .value(),
        ),
    ]);
    z.entry("archive/data.pkl", &pickle::write(&sd, Protocol::V2), 0);
    let inner = [local_header("archive/data/1", &[0; 4], 0), vec![0; 4]].concat();
    let mut outer = inner.clone();
    outer.resize(64, 0);
    let outer_at = z.entry("archive/data/0", &outer, 0).local_offset;
    let inner_at = outer_at + 30 + "archive/data/0".len() as u64;
    z.central.push(HandEntry {
        name: "archive/data/1".into(),
        local_offset: inner_at,
        size: 4,
        crc: crc32fast::hash(&[0; 4]),
        method: 0,
    });
    z.entry("archive/version", b"3\n", 0);
    assert_zip_refused(&z.finish(None), "overlap");
}

#[test]
fn zip_entry_pointing_outside_the_file() {
    let mut z = hand_archive();
    z.central[2].local_offset = 0xffff_fff0;
    assert_zip_refused(&z.finish(None), "points past the end");
    let mut z = hand_archive();
    z.central[2].size = 0x7fff_0000;
    let bytes = z.finish(None);
    let err = zip::read_entries(&bytes).unwrap_err().to_string();
    assert!(
        err.contains("disagrees") || err.contains("runs into"),
        "{err}"
    );
    let env = TestEnv::new();
    let bin = env.write("pytorch_model.bin", &bytes);
    assert_refused(&env, &bin, ALL, &["disagrees", "runs into"]);
}

#[test]
fn zip_central_directory_count_of_2_pow_32_minus_1() {
    let z = hand_archive();
    let cd_offset = z.bytes.len() as u64;
    let cd_size = z.central_bytes().len() as u64;
    assert_zip_refused(
        &z.finish_zip64(0xffff_ffff, cd_size, cd_offset, None),
        "4294967295 entries",
    );
    // The classic record alone claiming 65535 entries needs a zip64 record it lacks.
    assert_zip_refused(&z.finish(Some(0xffff)), "needs a zip64 end record");
    // A count larger than the directory can hold.
    assert_zip_refused(&z.finish(Some(1000)), "cannot hold 1000 entries");
}

#[test]
fn zip64_record_with_absurd_values() {
    let z = hand_archive();
    let cd_offset = z.bytes.len() as u64;
    let cd_size = z.central_bytes().len() as u64;
    assert_zip_refused(
        &z.finish_zip64(4, cd_size, u64::MAX - 10, None),
        "runs past the end records",
    );
    assert_zip_refused(
        &z.finish_zip64(4, u64::MAX, cd_offset, None),
        "runs past the end records",
    );
    assert_zip_refused(
        &z.finish_zip64(u64::MAX, cd_size, cd_offset, None),
        "entries",
    );
    assert_zip_refused(
        &z.finish_zip64(4, cd_size, cd_offset, Some(u64::MAX - 20)),
        "does not fit before its locator",
    );
    assert_zip_refused(
        &z.finish_zip64(4, cd_size, cd_offset, Some(0)),
        "zip64 end record signature not found",
    );
}

#[test]
fn zip_with_truncations_and_garbage() {
    let bytes = hand_archive().finish(None);
    for end in (0..bytes.len()).step_by(37) {
        assert!(
            zip::read_entries(&bytes[..end]).is_err(),
            "prefix {end} accepted"
        );
    }
    let env = TestEnv::new();
    let bin = env.write("pytorch_model.bin", &bytes[..bytes.len() / 2]);
    assert_refused(&env, &bin, ALL, &["zip"]);
    let bin = env.write("pytorch_model.bin", b"PK\x03\x04 definitely not a zip");
    assert_refused(&env, &bin, ALL, &["zip"]);
}

// ---------------------------------------------------------------------------------------------
// DCP metadata pointing at the wrong places
// ---------------------------------------------------------------------------------------------

/// Rewrite the first storage entry's `relative_path` to `path`, with a valid decoy at the place
/// it names (where one can be made), so that following the path would succeed.
fn assert_relative_path_refused(path: &str) {
    let env = TestEnv::new();
    // A real item file outside the checkpoint: reading it would "work".
    std::fs::copy(fixtures().join("dtypes/__0_0.distcp"), env.path("x.distcp")).unwrap();
    let dir = dtypes_with_metadata(&env, |m, _| {
        let first = &mut m.storage[0].1;
        first.relative_path = path.to_string();
    });
    assert_refused(&env, &dir, ALL, &["outside the checkpoint directory"]);
}

#[test]
fn dcp_relative_path_climbing_out() {
    assert_relative_path_refused("../x.distcp");
}

#[test]
fn dcp_relative_path_absolute() {
    assert_relative_path_refused("/etc/passwd");
}

#[test]
fn dcp_relative_path_climbing_out_through_a_subdirectory() {
    assert_relative_path_refused("sub/../../x.distcp");
}

#[test]
fn dcp_relative_path_with_nul_or_windows_tricks() {
    for p in [
        "__0_0.distcp\0",
        "__0_0.distcp\0../../x",
        "..\\x.distcp",
        "C:\\x.distcp",
        "",
    ] {
        let env = TestEnv::new();
        let dir = dtypes_with_metadata(&env, |m, _| m.storage[0].1.relative_path = p.to_string());
        assert_refused(&env, &dir, ALL, &["outside the checkpoint directory"]);
    }
}

/// A rank file that is a symlink out of the checkpoint: ckpt reads through it (as torch does);
/// what matters is that it writes nothing there. Recorded here so a policy change is deliberate.
#[test]
fn dcp_rank_file_that_is_a_symlink_out_is_only_read() {
    let env = TestEnv::new();
    let dir = env.copy_fixture("dtypes");
    let outside = env.path("outside.distcp");
    std::fs::rename(dir.join("__1_0.distcp"), &outside).unwrap();
    std::os::unix::fs::symlink(&outside, dir.join("__1_0.distcp")).unwrap();
    let before = std::fs::read(&outside).unwrap();
    let out = env.path("out.safetensors");
    let run = ckpt(&[&"consolidate", &dir, &"-o", &out, &"-q"]);
    assert_no_crash(&run, "consolidate");
    assert_eq!(std::fs::read(&outside).unwrap(), before);
}

#[test]
fn dcp_chunks_that_overlap() {
    let env = TestEnv::new();
    let dir = dtypes_with_metadata(&env, |m, _| {
        // Move the second chunk of the first sharded tensor one row up, onto the first chunk.
        for e in &mut m.entries {
            let DcpEntry::Tensor { fqn, chunks, .. } = e else {
                continue;
            };
            if chunks.len() < 2 || chunks[1].offsets.first() == Some(&0) || chunks[1].sizes[0] == 0
            {
                continue;
            }
            let old = chunks[1].offsets.clone();
            chunks[1].offsets[0] -= 1;
            let new = chunks[1].offsets.clone();
            for (idx, _) in &mut m.storage {
                if &idx.fqn == fqn && idx.offset.as_ref() == Some(&old) {
                    idx.offset = Some(new.clone());
                }
            }
            return;
        }
        panic!("no sharded tensor in the fixture");
    });
    assert_refused(&env, &dir, UNSOUND, &["overlap", "Overlap"]);
}

/// The first chunk with elements, of a tensor with at least one dimension.
fn first_real_chunk(m: &mut DcpMetadata) -> (&mut Vec<u64>, &mut Chunk) {
    m.entries
        .iter_mut()
        .find_map(|e| match e {
            DcpEntry::Tensor { size, chunks, .. } if size.first().is_some_and(|&d| d > 0) => chunks
                .iter_mut()
                .find(|c| !c.sizes.contains(&0))
                .map(|c| (size, c)),
            _ => None,
        })
        .expect("a tensor with a non-empty chunk")
}

#[test]
fn dcp_chunk_outside_the_tensor() {
    let env = TestEnv::new();
    let dir = dtypes_with_metadata(&env, |m, _| {
        let (size, chunk) = first_real_chunk(m);
        chunk.offsets[0] = size[0];
    });
    assert_refused(&env, &dir, ALL, &["does not fit in size"]);
}

#[test]
fn dcp_chunk_with_offsets_that_overflow() {
    let env = TestEnv::new();
    let dir = dtypes_with_metadata(&env, |m, _| {
        let (_, chunk) = first_real_chunk(m);
        chunk.offsets[0] = i64::MAX as u64;
        chunk.sizes[0] = i64::MAX as u64;
    });
    assert_refused(&env, &dir, ALL, &["does not fit in size"]);
}

#[test]
fn dcp_storage_entry_past_the_end_of_its_file() {
    let env = TestEnv::new();
    let dir = dtypes_with_metadata(&env, |m, dir| {
        let info = &mut m.storage[0].1;
        let len = std::fs::metadata(dir.join(&info.relative_path))
            .unwrap()
            .len();
        info.offset = len + 100;
    });
    assert_refused(&env, &dir, ALL, &["runs past the end of the file"]);
}

#[test]
fn dcp_storage_entry_with_a_length_past_the_end_of_its_file() {
    let env = TestEnv::new();
    let dir = dtypes_with_metadata(&env, |m, _| {
        m.storage[0].1.length = 1 << 40;
    });
    assert_refused(&env, &dir, ALL, &["runs past the end of the file"]);
    let dir2 = env.path("dtypes2");
    std::fs::rename(&dir, &dir2).unwrap();
    let dir = dtypes_with_metadata(&env, |m, _| {
        m.storage[0].1.offset = i64::MAX as u64;
        m.storage[0].1.length = i64::MAX as u64;
    });
    assert_refused(&env, &dir, ALL, &["runs past the end of the file", "2^64"]);
}

#[test]
fn dcp_value_entry_past_the_end_of_its_file() {
    let env = TestEnv::new();
    let dir = dtypes_with_metadata(&env, |m, _| {
        let bytes_fqn = m
            .entries
            .iter()
            .find_map(|e| match e {
                DcpEntry::Bytes { fqn } => Some(fqn.clone()),
                _ => None,
            })
            .unwrap();
        let info = &mut m
            .storage
            .iter_mut()
            .find(|(i, _)| i.fqn == bytes_fqn)
            .unwrap()
            .1;
        info.offset = 1 << 40;
    });
    assert_refused(&env, &dir, ALL, &["runs past the end of the file"]);
}

#[test]
fn dcp_storage_entry_missing_for_a_chunk() {
    let env = TestEnv::new();
    let dir = dtypes_with_metadata(&env, |m, _| {
        m.storage.remove(0);
    });
    assert_refused(&env, &dir, ALL, &["no storage entry"]);
}

#[test]
fn dcp_unsupported_transform() {
    let env = TestEnv::new();
    let dir = dtypes_with_metadata(&env, |m, _| {
        m.storage[0].1.transforms = vec!["stream.shell/1".into()];
    });
    assert_refused(&env, &dir, ALL, &["unsupported item transform"]);
}

/// A tensor of 2^60 elements with no chunks at all: the gap is found by arithmetic, not by
/// walking elements, and nothing tries to write 2^62 bytes.
#[test]
fn dcp_huge_tensor_with_no_chunks() {
    let env = TestEnv::new();
    let dir = dtypes_with_metadata(&env, |m, _| {
        m.entries.push(DcpEntry::Tensor {
            fqn: "ghost".into(),
            dtype: DType::F32,
            size: vec![1 << 30, 1 << 30],
            chunks: Vec::new(),
        });
    });
    assert_refused(&env, &dir, UNSOUND, &["in no piece", "cover"]);
}

/// A zstd item that inflates to 16 GiB of zeros from about 500 KiB (zstd RLE blocks): reading it
/// must not try to hold it all (each run is limited to 4 GiB of address space).
#[test]
fn dcp_zstd_decompression_bomb() {
    let env = TestEnv::new();
    let dir = env.copy_fixture("dcp_zstd");
    // A zstd frame of RLE blocks, each 128 KiB of zeros.
    let mut bomb = vec![0x28, 0xb5, 0x2f, 0xfd];
    bomb.push(0x00); // frame header: no content size, no checksum, window descriptor follows
    bomb.push(0x58); // window log 21 (2 MiB)
    let blocks = (16u64 << 30) / (128 << 10);
    for i in 0..blocks {
        let last = (i + 1 == blocks) as u32;
        let header = last | (1 << 1) | ((128u32 << 10) << 3); // RLE block of 128 KiB
        bomb.extend_from_slice(&header.to_le_bytes()[..3]);
        bomb.push(0);
    }
    let file = dir.join("__0_0.distcp");
    let mut bytes = std::fs::read(&file).unwrap();
    let at = bytes.len() as u64;
    bytes.extend_from_slice(&bomb);
    std::fs::write(&file, bytes).unwrap();
    let path = dir.join(".metadata");
    let mut meta = metadata::parse(&std::fs::read(&path).unwrap()).unwrap();
    let info = &mut meta
        .storage
        .iter_mut()
        .find(|(_, i)| i.relative_path == "__0_0.distcp")
        .unwrap()
        .1;
    info.offset = at;
    info.length = bomb.len() as u64;
    std::fs::write(&path, metadata::write(&meta)).unwrap();
    assert_refused(
        &env,
        &dir,
        ALL,
        &["zstd", "decompress", "too large", "larger"],
    );
}

/// Tens of thousands of chunks of one tensor, all pointing at the same item: a sound checkpoint
/// whose coverage check must not be quadratic enough to hang (each run has `RUN_LIMIT`).
#[test]
fn dcp_many_tiny_chunks() {
    let env = TestEnv::new();
    let n: u64 = 20_000;
    let one = Rebuild {
        storage_class: "FloatStorage",
        key: "0",
        numel: 1,
        offset: 0,
        size: &[1, 1],
        stride: &[1, 1],
    };
    let item = dcp_item(&one, f32_bytes(&[1.0]));
    let dir = dcp_with_item(&env, "ckpt", 1, &item);
    let meta = DcpMetadata {
        entries: vec![DcpEntry::Tensor {
            fqn: "w".into(),
            dtype: DType::F32,
            size: vec![1, n],
            chunks: (0..n)
                .map(|i| Chunk {
                    offsets: vec![0, i],
                    sizes: vec![1, 1],
                })
                .collect(),
        }],
        storage: (0..n)
            .map(|i| {
                (
                    MetadataIndex {
                        fqn: "w".into(),
                        offset: Some(vec![0, i]),
                        index: Some(0),
                    },
                    StorageInfo {
                        relative_path: "__0_0.distcp".into(),
                        offset: 0,
                        length: item.len() as u64,
                        transforms: Vec::new(),
                    },
                )
            })
            .collect(),
        planner_data: Vec::new(),
        version: Some("1.0.0".into()),
    };
    std::fs::write(dir.join(".metadata"), metadata::write(&meta)).unwrap();
    let started = Instant::now();
    let run = ckpt(&[&"verify", &dir]);
    assert_no_crash(&run, "verify");
    assert_eq!(run.code, Some(0), "{}", run.text);
    eprintln!("verify of {n} chunks took {:?}", started.elapsed());
}

// ---------------------------------------------------------------------------------------------
// Hugging Face index
// ---------------------------------------------------------------------------------------------

/// Copy `fixtures/hf_split` and point the first `weight_map` entry at `file`.
fn hf_with_weight_map_file(env: &TestEnv, file: &str) -> PathBuf {
    let dir = env.copy_fixture("hf_split");
    let index_path = dir.join("model.safetensors.index.json");
    let mut index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&index_path).unwrap()).unwrap();
    let map = index["weight_map"].as_object_mut().unwrap();
    let first = map.keys().next().unwrap().clone();
    map[&first] = serde_json::Value::String(file.into());
    std::fs::write(&index_path, serde_json::to_vec(&index).unwrap()).unwrap();
    dir
}

#[test]
fn hf_index_climbing_out() {
    let env = TestEnv::new();
    // A decoy next to the checkpoint: following the path would find a valid file.
    std::fs::copy(
        fixtures().join("hf_split/model-00001-of-00003.safetensors"),
        env.path("model-00001-of-00003.safetensors"),
    )
    .unwrap();
    let dir = hf_with_weight_map_file(&env, "../model-00001-of-00003.safetensors");
    assert_refused(&env, &dir, ALL, &["not a plain file name"]);
}

#[test]
fn hf_index_absolute_path() {
    let env = TestEnv::new();
    let decoy = env.path("decoy.safetensors");
    std::fs::copy(
        fixtures().join("hf_split/model-00001-of-00003.safetensors"),
        &decoy,
    )
    .unwrap();
    let dir = hf_with_weight_map_file(&env, &decoy.display().to_string());
    assert_refused(&env, &dir, ALL, &["not a plain file name"]);
}

#[test]
fn hf_index_nul_in_a_file_name() {
    let env = TestEnv::new();
    let dir = hf_with_weight_map_file(&env, "model-00001-of-00003.safetensors\0.txt");
    assert_refused(&env, &dir, ALL, &["not a plain file name"]);
}

#[test]
fn hf_index_naming_a_tensor_the_file_lacks() {
    let env = TestEnv::new();
    let dir = env.copy_fixture("hf_split");
    let index_path = dir.join("model.safetensors.index.json");
    let mut index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&index_path).unwrap()).unwrap();
    index["weight_map"].as_object_mut().unwrap().insert(
        "ghost.weight".into(),
        "model-00001-of-00003.safetensors".into(),
    );
    std::fs::write(&index_path, serde_json::to_vec(&index).unwrap()).unwrap();
    assert_refused(&env, &dir, ALL, &["does not hold it"]);
}

#[test]
fn hf_index_that_is_huge_or_not_json() {
    let env = TestEnv::new();
    let dir = env.copy_fixture("hf_split");
    let index_path = dir.join("model.safetensors.index.json");
    std::fs::write(&index_path, b"{\"weight_map\": [").unwrap();
    assert_refused(&env, &dir, ALL, &["index", "JSON", "json", "EOF"]);
    // Deeply nested JSON where a file name should be (serde_json's recursion limit must hold).
    let mut deep = b"{\"weight_map\": {\"a\": ".to_vec();
    deep.extend(std::iter::repeat_n(b'[', 100_000));
    deep.extend(std::iter::repeat_n(b']', 100_000));
    deep.extend_from_slice(b"}}");
    std::fs::write(&index_path, &deep).unwrap();
    assert_refused(&env, &dir, ALL, &["recursion", "not a file name"]);
}

/// An index that leaves out every tensor of one of the split files (a stale index next to
/// re-saved files): the file's tensors would be dropped without a word. `total_size` and the
/// `-0000k-of-0000n` names both show the index is incomplete.
#[test]
fn hf_index_omitting_a_whole_file() {
    let env = TestEnv::new();
    let dir = env.copy_fixture("hf_split");
    let index_path = dir.join("model.safetensors.index.json");
    let mut index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&index_path).unwrap()).unwrap();
    index["weight_map"]
        .as_object_mut()
        .unwrap()
        .retain(|_, file| file != "model-00003-of-00003.safetensors");
    std::fs::write(&index_path, serde_json::to_vec(&index).unwrap()).unwrap();
    assert_refused(
        &env,
        &dir,
        ALL,
        &["model-00003-of-00003.safetensors", "total_size"],
    );
    // The extreme case: an empty `weight_map` next to three files.
    index["weight_map"] = serde_json::json!({});
    std::fs::write(&index_path, serde_json::to_vec(&index).unwrap()).unwrap();
    assert_refused(&env, &dir, ALL, &["model-0000", "total_size"]);
}

// ---------------------------------------------------------------------------------------------
// DCP's safetensors flavour: names
// ---------------------------------------------------------------------------------------------

/// The tensors of one rank file: `(name, local shape, saved offsets)`.
type RankFile<'a> = &'a [(&'a str, &'a [u64], &'a [u64])];

/// Write rank files of `U8` tensors, one per rank.
fn dcp_hf_dir(env: &TestEnv, name: &str, ranks: &[RankFile]) -> PathBuf {
    let dir = env.path(name);
    std::fs::create_dir_all(&dir).unwrap();
    for (rank, tensors) in ranks.iter().enumerate() {
        let header: Vec<(String, DType, Vec<u64>)> = tensors
            .iter()
            .map(|(n, s, _)| (n.to_string(), DType::U8, s.to_vec()))
            .collect();
        let offsets: Vec<(String, Vec<u64>)> = tensors
            .iter()
            .map(|(n, _, o)| (n.to_string(), o.to_vec()))
            .collect();
        let meta = ckpt::formats::dcp::hf::sharding_metadata(&offsets);
        let (mut bytes, ranges) = ckpt::formats::safetensors::header_bytes(&header, &meta);
        let len = bytes.len() + ranges.last().map_or(0, |r| r.1 as usize);
        let start = bytes.len();
        bytes.resize(len, 0);
        for (i, b) in bytes[start..].iter_mut().enumerate() {
            *b = (rank * 100 + i) as u8;
        }
        std::fs::write(
            dir.join(ckpt::formats::dcp::hf::file_name(rank, 1, 1)),
            bytes,
        )
        .unwrap();
    }
    dir
}

/// Tensor names with `/` (and `..`) in a DCP safetensors checkpoint are names: read, consolidated
/// and kept, and no path is derived from them. (A file name cannot hold `/` or NUL at all, and a
/// rank file name is parsed strictly, so there is no file-name attack to make.)
#[test]
fn dcp_safetensors_tensor_names_with_slashes_and_nul() {
    let env = TestEnv::new();
    let names = ["enc/layer.0/w", "../../x", "a\0b"];
    let dir = dcp_hf_dir(
        &env,
        "ckpt",
        &[
            &[
                (names[0], &[2, 2], &[0, 0]),
                (names[1], &[1], &[0]),
                (names[2], &[1], &[0]),
            ],
            &[
                (names[0], &[1, 2], &[2, 0]),
                (names[1], &[1], &[1]),
                (names[2], &[1], &[1]),
            ],
        ],
    );
    assert_sound(&dir);
    let mut got = tensor_names(&dir);
    got.sort();
    let mut want: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    want.sort();
    assert_eq!(got, want);
    let out = env.path("out.safetensors");
    let run = ckpt(&[&"consolidate", &dir, &"-o", &out, &"-q"]);
    assert_eq!(run.code, Some(0), "{}", run.text);
    let mut got = tensor_names(&out);
    got.sort();
    assert_eq!(got, want);
    assert!(!env.path("x").exists());
}

#[test]
fn dcp_safetensors_saved_offsets_that_overflow_or_sprawl() {
    let env = TestEnv::new();
    // offset + size overflows u64.
    let dir = dcp_hf_dir(&env, "overflow", &[&[("w", &[2], &[u64::MAX])]]);
    assert_refused(&env, &dir, ALL, &["overflow"]);
    // One byte at offset 2^62: the inferred shape is 2^62 + 1 with a gap of 2^62 elements,
    // found without walking it.
    let dir = dcp_hf_dir(&env, "sprawl", &[&[("w", &[1], &[1 << 62])]]);
    assert_refused(&env, &dir, UNSOUND, &["in no piece", "cover"]);
    // Two such tensors of one dtype, 2^63 bytes each: inspect's totals saturate, not overflow.
    let two: RankFile = &[("v", &[1], &[1 << 63]), ("w", &[1], &[1 << 63])];
    let dir = dcp_hf_dir(&env, "sprawl2", &[two]);
    for args in [&["inspect"][..], &["inspect", "--json"]] {
        let run = ckpt(&[
            &args[0],
            &args.get(1).copied().unwrap_or("--filter=*"),
            &dir,
        ]);
        assert_no_crash(&run, "inspect of two sprawling tensors");
    }
}

#[test]
fn dcp_safetensors_sharding_info_that_lies() {
    let env = TestEnv::new();
    // Offsets with the wrong number of dimensions.
    let dir = dcp_hf_dir(&env, "dims", &[&[("w", &[2], &[0, 0])]]);
    assert_refused(&env, &dir, ALL, &["dimensions"]);
    // Two ranks claiming the same box with different data is an overlap only when the boxes
    // differ; here they partly overlap.
    let dir = dcp_hf_dir(
        &env,
        "overlap",
        &[&[("w", &[2], &[0])], &[("w", &[2], &[1])]],
    );
    assert_refused(&env, &dir, UNSOUND, &["overlap", "Overlap"]);
}

// ---------------------------------------------------------------------------------------------
// What ckpt prints and writes
// ---------------------------------------------------------------------------------------------

/// Names are attacker-chosen text: printed raw, an ESC or BEL in a tensor name or dtype lets a
/// checkpoint drive the user's terminal (retitle it, clear it, set the clipboard with OSC 52, hide
/// lines). Human-readable output must show control characters escaped; `--json` escapes them by
/// construction.
#[test]
fn control_characters_in_names_are_not_printed_raw() {
    let env = TestEnv::new();
    // JSON escapes: ESC ] 52 (OSC 52, clipboard), BEL, ESC [2J (clear), ESC [1A (cursor up), CR.
    let evil = r"w\u001b]52;c;cHduZWQ=\u0007\u001b[2J\u001b[1A\r";
    let h = format!(r#"{{"{evil}":{{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}}}"#);
    let named = env.write("named.safetensors", &safetensors_bytes(&h, 1));
    let h = format!(r#"{{"a":{{"dtype":"{evil}","shape":[1],"data_offsets":[0,1]}}}}"#);
    let dtype = env.write("dtype.safetensors", &safetensors_bytes(&h, 1));
    let runs = [
        ("inspect", ckpt(&[&"inspect", &named])),
        ("verify", ckpt(&[&"verify", &named, &"--deep"])),
        ("verify", ckpt(&[&"verify", &dtype])),
        ("inspect", ckpt(&[&"inspect", &dtype])),
    ];
    for (what, run) in runs {
        assert_no_crash(&run, what);
        let raw: Vec<char> = run
            .text
            .chars()
            .filter(|c| c.is_control() && *c != '\n')
            .collect();
        assert!(
            raw.is_empty(),
            "{what} printed control characters {raw:?}:\n{}",
            run.text.escape_debug()
        );
    }
}

/// Stale temporaries (`.NAME.ckpt-tmp-PID` of a dead process) are removed before a run; one
/// planted as a symlink must be unlinked, never followed into what it points at.
#[test]
fn stale_temporaries_that_are_symlinks_are_unlinked_not_followed() {
    let env = TestEnv::new();
    let victim_file = env.write("victim/file.txt", b"keep me");
    let victim_dir = env.path("victim");
    let out = env.path("out.safetensors");
    // PIDs above the kernel's maximum (4194304) never belong to a live process.
    let to_file = env.path(".out.safetensors.ckpt-tmp-4999998");
    let to_dir = env.path(".out.safetensors.ckpt-tmp-4999999");
    std::os::unix::fs::symlink(&victim_file, &to_file).unwrap();
    std::os::unix::fs::symlink(&victim_dir, &to_dir).unwrap();
    let run = ckpt(&[
        &"consolidate",
        &fixtures().join("single.safetensors"),
        &"-o",
        &out,
        &"-q",
    ]);
    assert_eq!(run.code, Some(0), "{}", run.text);
    assert_eq!(std::fs::read(&victim_file).unwrap(), b"keep me");
    assert!(to_file.symlink_metadata().is_err() && to_dir.symlink_metadata().is_err());
}
