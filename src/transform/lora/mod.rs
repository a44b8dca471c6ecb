//! LoRA adapters folded into their base weights (`--merge-lora`), as PEFT's `merge_and_unload`
//! does: a step between reading and selection, like [`crate::transform::fsdp_local::apply`].
//!
//! The adapter's tensors come from the checkpoint itself (a PEFT-wrapped model saved whole or
//! sharded: `…q_proj.base_layer.weight`, `…q_proj.lora_A.default.weight`) or, when the config's
//! directory holds `adapter_model.safetensors`, from there. The names are the base model's: the
//! wrapper prefix `base_model.model.`, `.base_layer` and the adapter's name removed, the
//! adapter's tensors consumed.
//!
//! Where the fold happens. A merged weight keeps its base weight's pieces, marked computed
//! ([`crate::model::Compute`]): the planner plans it like any tensor, and the executor, having
//! gathered a block of the base weight's bytes as it would copy them, hands them to the module's
//! fold, which writes the merged block (its module's A and B read when its first block is, let go
//! after its last). The fold moved there from a step of its own that wrote every merged weight
//! into a scratch file beside the output for the copy to read back: on a 1 GB model that wrote
//! every merged byte twice and made `--merge-lora` cost about ten times the plain consolidate
//! (2-3 s against 0.2-0.3 s on 272 MB). Computed where it is copied, each byte is written once,
//! memory stays one copy block per worker, the base weight is read through every storage the
//! executor reads (maps, objects), and a `--part` folds only the blocks of its own share. The
//! arithmetic is in [`fold`], box by box.

pub(crate) mod config;
pub(crate) mod fold;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::exec::IoMode;
use crate::model::{Checkpoint, Compute, Computed, Format, NonTensor, Pieces, Tensor};

pub(crate) use config::LoraConfig;

/// The prefix PEFT's `PeftModel` puts before the base model's names.
const WRAPPER: &str = "base_model.model.";

/// How `--merge-lora` runs.
#[derive(Clone, Debug)]
pub(crate) struct LoraOptions<'a> {
    /// PEFT's `adapter_config.json` or the directory holding it.
    pub config: &'a Path,
    /// `--adapter`: which of the checkpoint's adapters to merge.
    pub adapter: Option<&'a str>,
    /// How the adapter's tensors (and a DoRA module's base weight) are read.
    pub io: IoMode,
}

/// What a name of a PEFT-wrapped model says it is, after the wrapper prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Role {
    /// `M.lora_A.N.weight` (or `M.lora_A.weight` in an adapter file, `N` empty).
    A,
    B,
    Magnitude,
    EmbeddingA,
    EmbeddingB,
    /// `M.lora_B.N.bias` and other adapter tensors ckpt does not merge.
    Other(String),
}

/// An adapter tensor's module, role and adapter name (empty in an adapter file).
#[derive(Clone, Debug)]
struct AdapterName {
    module: String,
    role: Role,
    adapter: String,
}

/// `name` without PEFT's wrapper prefix, at the start or after an outer prefix (`model.` of an
/// app state saved with DCP).
fn unwrap_name(name: &str) -> String {
    if let Some(rest) = name.strip_prefix(WRAPPER) {
        return rest.to_string();
    }
    match name.find(&format!(".{WRAPPER}")) {
        Some(at) => format!("{}{}", &name[..at + 1], &name[at + 1 + WRAPPER.len()..]),
        None => name.to_string(),
    }
}

/// Parse an adapter tensor's (unwrapped) name; `None` for a base model tensor. In a saved
/// checkpoint the adapter name follows the role (`lora_A.default.weight`); in PEFT's
/// adapter file it is gone (`lora_A.weight`, `lora_magnitude_vector`, `lora_embedding_A`).
fn adapter_name(name: &str, in_file: bool) -> Option<AdapterName> {
    const ROLES: [&str; 5] = [
        ".lora_A.",
        ".lora_B.",
        ".lora_magnitude_vector",
        ".lora_embedding_A",
        ".lora_embedding_B",
    ];
    let (at, marker) = ROLES
        .iter()
        .filter_map(|m| name.find(m).map(|at| (at, *m)))
        .min_by_key(|(at, _)| *at)?;
    let module = name[..at].to_string();
    let rest = &name[at + marker.len()..];
    let rest = rest.strip_prefix('.').unwrap_or(rest);
    // What follows the role: `N.weight`, `weight`, `N`, ``.
    let parts: Vec<&str> = if rest.is_empty() {
        Vec::new()
    } else {
        rest.split('.').collect()
    };
    let (adapter, tail) = if in_file {
        (String::new(), parts.join("."))
    } else {
        match parts.split_first() {
            Some((n, tail)) => (n.to_string(), tail.join(".")),
            None => (String::new(), String::new()),
        }
    };
    let role = match (marker, tail.as_str()) {
        (".lora_A.", "weight") => Role::A,
        (".lora_B.", "weight") => Role::B,
        (".lora_magnitude_vector", "weight" | "") => Role::Magnitude,
        (".lora_embedding_A", "") => Role::EmbeddingA,
        (".lora_embedding_B", "") => Role::EmbeddingB,
        _ => Role::Other(name.to_string()),
    };
    Some(AdapterName {
        module,
        role,
        adapter,
    })
}

/// One module to fold: where its tensors are.
#[derive(Clone, Debug)]
struct Module {
    /// Index of the base weight in the base tensors.
    weight: usize,
    a: usize,
    b: usize,
    magnitude: Option<usize>,
    fold: fold::Fold,
    r: u64,
}

/// The directory `--merge-lora CONFIG` reads: CONFIG, or the directory holding it.
pub(crate) fn config_dir(config: &Path) -> PathBuf {
    if crate::storage::is_dir(config) {
        return config.to_path_buf();
    }
    match config.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// The LoRA modules a checkpoint holds, by adapter: (module, rank), for `inspect`.
pub(crate) fn held(ckpt: &Checkpoint) -> BTreeMap<String, Vec<(String, u64)>> {
    let mut out: BTreeMap<String, Vec<(String, u64)>> = BTreeMap::new();
    for t in &ckpt.tensors {
        let name = unwrap_name(&t.name);
        // A saved model names the adapter (`lora_A.default.weight`), PEFT's file does not.
        let Some(a) = adapter_name(&name, false)
            .filter(|a| matches!(a.role, Role::A | Role::EmbeddingA))
            .or_else(|| adapter_name(&name, true))
        else {
            continue;
        };
        if matches!(a.role, Role::A | Role::EmbeddingA) {
            let name = if a.adapter.is_empty() {
                "default".to_string()
            } else {
                a.adapter
            };
            out.entry(name)
                .or_default()
                .push((a.module, t.shape.first().copied().unwrap_or(0)));
        }
    }
    out
}

/// What `inspect` says of the LoRA adapters a checkpoint holds: one detail per adapter.
pub(crate) fn describe(ckpt: &Checkpoint, config: Option<&LoraConfig>) -> Vec<(String, String)> {
    held(ckpt)
        .into_iter()
        .map(|(adapter, modules)| {
            let kinds: BTreeSet<&str> = modules
                .iter()
                .map(|(m, _)| m.rsplit('.').next().unwrap_or(m))
                .collect();
            let ranks: BTreeSet<u64> = modules.iter().map(|(_, r)| *r).collect();
            let ranks: Vec<String> = ranks.iter().map(u64::to_string).collect();
            let mut line = format!(
                "{} modules ({}), r {}",
                modules.len(),
                kinds.into_iter().collect::<Vec<_>>().join(", "),
                ranks.join("/")
            );
            if let Some(c) = config {
                let mut alphas: Vec<f64> = modules
                    .iter()
                    .map(|(m, _)| c.rank_alpha(&unwrap_name(m)).1)
                    .collect();
                alphas.sort_by(f64::total_cmp);
                alphas.dedup();
                let alphas: Vec<String> = alphas.iter().map(f64::to_string).collect();
                line.push_str(&format!(", alpha {}", alphas.join("/")));
                if c.use_dora {
                    line.push_str(", DoRA");
                }
            }
            (format!("lora adapter `{adapter}`"), line)
        })
        .collect()
}

/// Fold the adapter described by `opts.config` into `ckpt`: its merged weights are computed
/// from their base weights' pieces as the executor copies them ([`Compute`]).
pub(crate) fn apply(ckpt: Checkpoint, opts: &LoraOptions) -> Result<Checkpoint> {
    let (config, loc) = config::read(opts.config)?;
    if config.lora_bias {
        return Err(Error::invalid(
            "the adapter trains biases of its own (`lora_bias`), which ckpt does not merge",
        )
        .file(&loc.config));
    }
    let Unwrapped {
        base,
        own,
        saved_copies,
        originals,
    } = unwrap_tensors(ckpt.tensors);
    // The checkpoint's own adapter tensors win: PEFT's `save_pretrained` also writes
    // adapter_model.safetensors beside the config of a wrapped model saved whole.
    let adapter_ckpt = match &loc.adapter_file {
        Some(file) if own.is_empty() => Some(crate::detect::read(file)?),
        _ => None,
    };
    let chosen = match adapter_ckpt {
        Some(_) => String::new(),
        None => choose_adapter(&own, opts.adapter, &loc)?,
    };
    let mut base = keep_chosen_modules(base, &saved_copies, &originals, &chosen);
    let adapter = match adapter_ckpt {
        Some(a) => from_adapter_file(a, &mut base, &loc)?,
        None => AdapterTensors {
            root: ckpt.root.clone(),
            format: ckpt.format,
            tensors: own
                .into_iter()
                .filter(|(a, _)| a.adapter == chosen)
                .collect(),
        },
    };
    let modules = modules(&adapter.tensors, &base, &config, &loc)?;
    // Each merged weight keeps its base weight's pieces and is computed from them as they are
    // copied; its module's adapter is read when the first box of it is.
    for m in modules {
        attach_fold(&mut base, m, &adapter, (&ckpt.root, ckpt.format), opts.io);
    }
    Ok(Checkpoint {
        tensors: base,
        values: unwrap_values(ckpt.values),
        ..ckpt
    })
}

/// A PEFT-wrapped model's tensors, unwrapped and sorted by what they are.
struct Unwrapped {
    /// The base model's tensors, `.base_layer` removed.
    base: Vec<Tensor>,
    /// The checkpoint's own adapter tensors, set apart.
    own: Vec<(AdapterName, Tensor)>,
    /// `M.modules_to_save.N.P`: (N, index in base), renamed `M.P`.
    saved_copies: Vec<(String, usize)>,
    /// `M.original_module.P`, the module before training: indices in base.
    originals: Vec<usize>,
}

/// The checkpoint's tensors without PEFT's wrapper, its own adapter tensors set apart.
fn unwrap_tensors(tensors: Vec<Tensor>) -> Unwrapped {
    let mut out = Unwrapped {
        base: Vec::new(),
        own: Vec::new(),
        saved_copies: Vec::new(),
        originals: Vec::new(),
    };
    for mut t in tensors {
        let name = unwrap_name(&t.name);
        if let Some(a) = adapter_name(&name, false) {
            out.own.push((a, t));
            continue;
        }
        let name = name.replacen(".base_layer.", ".", 1);
        if name != t.name {
            t.name = name;
            t.key_path.clear();
        }
        if let Some((m, rest)) = t.name.split_once(".modules_to_save.") {
            if let Some((n, p)) = rest.split_once('.') {
                out.saved_copies.push((n.to_string(), out.base.len()));
                t.name = format!("{m}.{p}");
            }
        } else if t.name.contains(".original_module.") {
            out.originals.push(out.base.len());
        }
        out.base.push(t);
    }
    out
}

/// The name of the adapter to merge among the checkpoint's own (`own`): the one `--adapter`
/// names, the only one, or the one the config's directory is named after.
fn choose_adapter(
    own: &[(AdapterName, Tensor)],
    requested: Option<&str>,
    loc: &config::ConfigLocation,
) -> Result<String> {
    let held: BTreeSet<&str> = own.iter().map(|(a, _)| a.adapter.as_str()).collect();
    match (requested, held.len()) {
        (Some(n), _) if held.contains(n) => Ok(n.to_string()),
        (Some(n), _) => Err(Error::invalid(format!(
            "the checkpoint holds no LoRA adapter `{n}`{}",
            listed(&held)
        ))
        .hint("--adapter names one the checkpoint holds")),
        (None, 0) => Err(
            Error::invalid("the checkpoint holds no LoRA adapter tensors to merge").hint(format!(
                "put PEFT's {} beside `{}` to merge an adapter saved apart",
                config::ADAPTER_FILE,
                loc.config.display()
            )),
        ),
        (None, 1) => Ok(held
            .iter()
            .next()
            .map(|s| s.to_string())
            .unwrap_or_default()),
        (None, _) => match loc.dir_name.as_deref().filter(|d| held.contains(d)) {
            Some(d) => Ok(d.to_string()),
            None => Err(Error::usage(format!(
                "the checkpoint holds several LoRA adapters{} and the config does not say which",
                listed(&held)
            ))
            .hint("name one with --adapter NAME")),
        },
    }
}

/// `base` with the modules_to_save of adapter `chosen`: its copy replaces the module, as
/// `merge_and_unload` does; a module without one for this adapter keeps its original.
fn keep_chosen_modules(
    mut base: Vec<Tensor>,
    saved_copies: &[(String, usize)],
    originals: &[usize],
    chosen: &str,
) -> Vec<Tensor> {
    let copied: BTreeSet<usize> = saved_copies
        .iter()
        .filter(|(n, _)| *n == chosen)
        .map(|(_, i)| *i)
        .collect();
    let copied_names: BTreeSet<String> = copied.iter().map(|&i| base[i].name.clone()).collect();
    let mut dropped: BTreeSet<usize> = saved_copies
        .iter()
        .filter(|(n, _)| *n != chosen)
        .map(|(_, i)| *i)
        .collect();
    for &i in originals {
        let name = base[i].name.replacen(".original_module.", ".", 1);
        if copied_names.contains(&name) {
            dropped.insert(i);
        } else {
            base[i].name = name;
        }
    }
    base.into_iter()
        .enumerate()
        .filter(|(i, _)| !dropped.contains(i))
        .map(|(_, t)| t)
        .collect()
}

/// The adapter tensors to merge and where they are read from.
struct AdapterTensors {
    /// The root their pieces' files are relative to.
    root: PathBuf,
    format: Format,
    tensors: Vec<(AdapterName, Tensor)>,
}

/// The adapter tensors of PEFT's adapter file `a`; its other tensors replace those of `base`.
fn from_adapter_file(
    a: Checkpoint,
    base: &mut [Tensor],
    loc: &config::ConfigLocation,
) -> Result<AdapterTensors> {
    let root = a.root.clone();
    let mut list = Vec::new();
    for t in a.tensors {
        let name = unwrap_name(&t.name);
        match adapter_name(&name, true) {
            Some(an) => list.push((an, t)),
            None => {
                // modules_to_save copies, trained biases and an adapted embedding's
                // `base_layer.weight` replace the base tensor, as loading the adapter does.
                let name = name.replacen(".base_layer.", ".", 1);
                let Some(i) = base.iter().position(|b| b.name == name) else {
                    return Err(Error::invalid(format!(
                        "the adapter's tensor `{}` replaces `{name}`, which the checkpoint does not hold",
                        t.name
                    ))
                    .file(loc.adapter_file.as_deref().unwrap_or(&loc.config)));
                };
                let mut t = t;
                t.name = name;
                t.key_path.clear();
                base[i] = absolute(t, &root)?;
            }
        }
    }
    Ok(AdapterTensors {
        root,
        format: a.format,
        tensors: list,
    })
}

/// `e` naming the adapter file, when the adapter was read from one.
fn in_adapter_file(e: Error, loc: &config::ConfigLocation) -> Error {
    match loc.adapter_file.as_deref() {
        Some(f) => e.file(f),
        None => e,
    }
}

/// Every adapted module, checked against its base weight and the config, with its fold.
fn modules(
    adapter: &[(AdapterName, Tensor)],
    base: &[Tensor],
    config: &LoraConfig,
    loc: &config::ConfigLocation,
) -> Result<Vec<Module>> {
    let by_module = group_by_module(adapter, loc)?;
    let base_index: HashMap<&str, usize> = base
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.as_str(), i))
        .collect();
    let mut modules = Vec::new();
    for (module, roles) in &by_module {
        let at = locate_module(module, roles, adapter, &base_index, loc)?;
        modules.push(check_module(module, at, adapter, base, config, loc)?);
    }
    if modules.is_empty() {
        return Err(in_adapter_file(
            Error::invalid("the adapter holds no LoRA modules to merge"),
            loc,
        ));
    }
    Ok(modules)
}

/// The adapter tensors by module: each role's index in `adapter`.
fn group_by_module(
    adapter: &[(AdapterName, Tensor)],
    loc: &config::ConfigLocation,
) -> Result<BTreeMap<String, HashMap<&'static str, usize>>> {
    let mut by_module: BTreeMap<String, HashMap<&'static str, usize>> = BTreeMap::new();
    for (k, (a, t)) in adapter.iter().enumerate() {
        let role = match &a.role {
            Role::A => "A",
            Role::B => "B",
            Role::Magnitude => "magnitude",
            Role::EmbeddingA => "embA",
            Role::EmbeddingB => "embB",
            Role::Other(_) => {
                return Err(in_adapter_file(
                    Error::invalid("ckpt does not merge this LoRA tensor (a LoRA bias?)")
                        .tensor(&t.name),
                    loc,
                ))
            }
        };
        by_module
            .entry(a.module.clone())
            .or_default()
            .insert(role, k);
    }
    Ok(by_module)
}

/// Where one module's tensors are: indices into the adapter tensors and the base tensors.
struct ModuleAt {
    embedding: bool,
    a: usize,
    b: usize,
    magnitude: Option<usize>,
    weight: usize,
}

/// The tensors of `module` (its `roles` in `adapter`): both of its LoRA pair and its base weight.
fn locate_module(
    module: &str,
    roles: &HashMap<&'static str, usize>,
    adapter: &[(AdapterName, Tensor)],
    base_index: &HashMap<&str, usize>,
    loc: &config::ConfigLocation,
) -> Result<ModuleAt> {
    let first = &adapter[*roles.values().min().unwrap_or(&0)].1.name;
    let embedding = roles.contains_key("embA") || roles.contains_key("embB");
    let (ka, kb) = if embedding {
        (roles.get("embA"), roles.get("embB"))
    } else {
        (roles.get("A"), roles.get("B"))
    };
    let (Some(&ka), Some(&kb)) = (ka, kb) else {
        return Err(in_adapter_file(
            Error::invalid(format!(
                "module `{module}` has only half of a LoRA pair (A and B)"
            ))
            .tensor(first),
            loc,
        ));
    };
    let weight_name = format!("{module}.weight");
    let Some(&wi) = base_index.get(weight_name.as_str()) else {
        return Err(in_adapter_file(
            Error::invalid(format!(
                "the LoRA adapter of `{module}` has no base weight `{weight_name}` in the checkpoint"
            ))
            .tensor(first),
            loc,
        ));
    };
    Ok(ModuleAt {
        embedding,
        a: ka,
        b: kb,
        magnitude: roles.get("magnitude").copied(),
        weight: wi,
    })
}

/// Module `module` once its shapes fit each other and the config and its dtypes are ones
/// the fold computes in, with its fold.
fn check_module(
    module: &str,
    at: ModuleAt,
    adapter: &[(AdapterName, Tensor)],
    base: &[Tensor],
    config: &LoraConfig,
    loc: &config::ConfigLocation,
) -> Result<Module> {
    let (a, b) = (&adapter[at.a].1, &adapter[at.b].1);
    let w = &base[at.weight];
    let magnitude = at.magnitude.map(|k| &adapter[k].1);
    if a.shape.len() != 2 || b.shape.len() != 2 || w.shape.len() != 2 {
        return Err(in_adapter_file(
            Error::invalid(format!(
                "only 2-D LoRA modules are merged (linear and embedding); `{module}` has A {:?}, B {:?}, weight {:?}",
                a.shape, b.shape, w.shape
            ))
            .tensor(&a.name),
            loc,
        ));
    }
    let (r, inn) = (a.shape[0], a.shape[1]);
    let out = b.shape[0];
    let (want_r, alpha) = config.rank_alpha(&unwrap_name(module));
    if want_r != r || b.shape[1] != r {
        return Err(in_adapter_file(
            Error::invalid(format!(
                "the config gives `{module}` rank {want_r} but its A is {:?} and its B {:?}",
                a.shape, b.shape
            ))
            .tensor(&a.name)
            .file(&loc.config),
            loc,
        ));
    }
    let fan_in_fan_out = fan_in_fan_out(&w.shape, [out, inn], config);
    let transposed = at.embedding || fan_in_fan_out;
    let want_w = if transposed { [inn, out] } else { [out, inn] };
    if w.shape != want_w {
        return Err(Error::invalid(format!(
            "the base weight is {:?}, which does not fit B @ A of its LoRA adapter ([{out}, {inn}]{})",
            w.shape,
            if transposed { ", transposed" } else { "" }
        ))
        .tensor(&w.name));
    }
    for t in [w, a, b].into_iter().chain(magnitude) {
        if !matches!(t.dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(Error::invalid(format!(
                "LoRA is merged in f32, bf16 or f16, not {}",
                t.dtype
            ))
            .tensor(&t.name));
        }
    }
    if let Some(m) = magnitude {
        if m.shape != [out] {
            return Err(in_adapter_file(
                Error::invalid(format!("the DoRA magnitude is {:?}, not [{out}]", m.shape))
                    .tensor(&m.name),
                loc,
            ));
        }
    }
    Ok(Module {
        weight: at.weight,
        a: at.a,
        b: at.b,
        magnitude: at.magnitude,
        fold: fold::Fold {
            kind: if at.embedding {
                fold::Kind::Embedding
            } else {
                fold::Kind::Linear { fan_in_fan_out }
            },
            scaling: config.scaling(r, alpha),
            weight: w.dtype,
            adapter: b.dtype,
            magnitude: magnitude.map(|m| m.dtype),
        },
        r,
    })
}

/// Whether a base weight of `shape` is stored transposed (`[in, out]`, a Conv1D's) for a
/// LoRA product `B @ A` of `[out, inn]`.
fn fan_in_fan_out(shape: &[u64], [out, inn]: [u64; 2], config: &LoraConfig) -> bool {
    // PEFT sets `fan_in_fan_out` per module type (Conv1D or Linear) on the shared config, so
    // the file holds the last module's: the weight's shape decides, the file only when square.
    if shape == [inn, out] && shape != [out, inn] {
        true
    } else if shape == [out, inn] && shape != [inn, out] {
        false
    } else {
        config.fan_in_fan_out
    }
}

/// `base[m.weight]` made a computed tensor: `m`'s fold of its base weight's pieces, reading the
/// adapter's tensors (and, for DoRA, the base weight from the checkpoint at `root`, of
/// `format`) when its first box is computed.
fn attach_fold(
    base: &mut [Tensor],
    m: Module,
    adapter: &AdapterTensors,
    (root, format): (&Path, Format),
    io: IoMode,
) {
    let t = &base[m.weight];
    let mut ab = vec![
        adapter.tensors[m.a].1.clone(),
        adapter.tensors[m.b].1.clone(),
    ];
    ab.extend(m.magnitude.map(|k| adapter.tensors[k].1.clone()));
    let weight = m.magnitude.map(|_| numbered(vec![t.clone()], root, format));
    let fold = ModuleFold {
        fold: m.fold,
        r: m.r as usize,
        numel: crate::model::numel(&t.shape).unwrap_or(0),
        adapter: numbered(ab, &adapter.root, adapter.format),
        weight,
        io,
        state: std::sync::Mutex::new(Held::default()),
    };
    base[m.weight].pieces.set_computed(Computed(Arc::new(fold)));
}

/// A checkpoint of `tensors` alone, named `0`, `1`, ... in their order, for a fold to read.
fn numbered(tensors: Vec<Tensor>, root: &Path, format: Format) -> Checkpoint {
    Checkpoint {
        root: root.to_path_buf(),
        format,
        world_size: None,
        tensors: tensors
            .into_iter()
            .enumerate()
            .map(|(i, mut t)| {
                t.name = format!("{i}");
                t.key_path.clear();
                t
            })
            .collect(),
        values: Vec::new(),
        unsupported: Vec::new(),
        details: Vec::new(),
    }
}

/// `values` named without PEFT's wrapper prefix.
fn unwrap_values(values: Vec<NonTensor>) -> Vec<NonTensor> {
    values
        .into_iter()
        .map(|mut v| {
            let name = unwrap_name(&v.name);
            if name != v.name {
                v.name = name;
                v.key_path.clear();
            }
            v
        })
        .collect()
}

impl super::Step for LoraOptions<'_> {
    fn apply(&self, ckpt: Checkpoint, _: &mut super::Report) -> Result<Checkpoint> {
        apply(ckpt, self)
    }
}

/// One module's fold, computed box by box as the executor copies its base weight.
struct ModuleFold {
    fold: fold::Fold,
    r: usize,
    /// Elements of the weight.
    numel: u64,
    /// A, B and the DoRA magnitude, in that order (named `0`, `1`, `2`).
    adapter: Checkpoint,
    /// The base weight alone (named `0`), read whole for DoRA's norms.
    weight: Option<Checkpoint>,
    io: IoMode,
    state: std::sync::Mutex<Held>,
}

/// A module's adapter while its weight is being computed.
#[derive(Default)]
struct Held {
    loaded: Option<Arc<Loaded>>,
    /// Elements computed since it was read: once the whole weight has been, it is let go, so
    /// that a run holds the adapters of the modules being copied, not all of them.
    done: u64,
}

struct Loaded {
    a: Vec<f32>,
    b: Vec<f32>,
    factor: Option<Vec<f32>>,
}

impl ModuleFold {
    fn load(&self) -> Result<Loaded> {
        let mut bytes = crate::exec::read_tensors(&self.adapter, self.io)?.into_iter();
        let mut next = |k: usize| {
            let t = &self.adapter.tensors[k];
            bytes
                .next()
                .map(|b| to_f32(&b, t.dtype))
                .ok_or_else(|| Error::bug("an adapter tensor was not read"))
        };
        let (a, b) = (next(0)?, next(1)?);
        let factor = match &self.weight {
            Some(w) => {
                let magnitude = next(2)?;
                let wb = crate::exec::read_tensors(w, self.io)?
                    .pop()
                    .ok_or_else(|| Error::bug("a base weight was not read"))?;
                let ad = fold::Adapter {
                    a: &a,
                    b: &b,
                    r: self.r,
                    factor: None,
                };
                Some(fold::dora_factor(&self.fold, &ad, &wb, &magnitude)?)
            }
            None => None,
        };
        Ok(Loaded { a, b, factor })
    }
}

impl Compute for ModuleFold {
    fn compute(
        &self,
        start: &[u64],
        sizes: &[u64],
        src: &[u8],
        dst: &mut [u8],
        dst_dtype: DType,
    ) -> Result<()> {
        let (&[row, col], &[rows, cols]) = (start, sizes) else {
            return Err(Error::bug("a LoRA fold of a box that is not 2-D"));
        };
        let lock = || self.state.lock().unwrap_or_else(|e| e.into_inner());
        let loaded = {
            let mut held = lock();
            match &held.loaded {
                Some(l) => l.clone(),
                None => {
                    let l = Arc::new(self.load()?);
                    held.loaded = Some(l.clone());
                    l
                }
            }
        };
        let ad = fold::Adapter {
            a: &loaded.a,
            b: &loaded.b,
            r: self.r,
            factor: loaded.factor.as_deref(),
        };
        fold::fold_box(
            &self.fold,
            &ad,
            [row as usize, col as usize],
            [rows as usize, cols as usize],
            src,
            dst,
            dst_dtype,
        )?;
        let mut held = lock();
        held.done += rows * cols;
        if held.done >= self.numel {
            *held = Held::default();
        }
        Ok(())
    }
}

fn listed(held: &BTreeSet<&str>) -> String {
    if held.is_empty() {
        return String::new();
    }
    let names: Vec<String> = held.iter().map(|n| format!("`{n}`")).collect();
    format!(" ({})", names.join(", "))
}

/// A tensor of another checkpoint (the adapter file), its files named absolutely so that it
/// reads from any root.
fn absolute(t: Tensor, root: &Path) -> Result<Tensor> {
    let ndim = t.pieces.ndim();
    let pieces = (0..t.pieces.len())
        .map(|k| {
            let mut p = t.pieces.get(k).to_piece();
            let path = root.join(&*p.data.file);
            p.data.file = Arc::from(std::path::absolute(&path).unwrap_or(path).as_path());
            p
        })
        .collect();
    Ok(Tensor {
        pieces: Pieces::from_vec(ndim, pieces)?,
        ..t
    })
}

fn to_f32(bytes: &[u8], dtype: DType) -> Vec<f32> {
    let n = bytes.len() / dtype.size();
    let mut raw = vec![0u8; n * 4];
    crate::cast::convert(bytes, dtype, &mut raw, DType::F32);
    raw.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_unwrap() {
        assert_eq!(
            unwrap_name("base_model.model.model.layers.0.q_proj.base_layer.weight"),
            "model.layers.0.q_proj.base_layer.weight"
        );
        assert_eq!(
            unwrap_name("model.base_model.model.lm_head.weight"),
            "model.lm_head.weight"
        );
        assert_eq!(unwrap_name("lm_head.weight"), "lm_head.weight");
    }

    #[test]
    fn adapter_names_parse() {
        let a = adapter_name("m.q_proj.lora_A.default.weight", false).unwrap();
        assert_eq!(
            (a.module.as_str(), a.adapter.as_str()),
            ("m.q_proj", "default")
        );
        assert_eq!(a.role, Role::A);
        let a = adapter_name("m.q_proj.lora_B.weight", true).unwrap();
        assert_eq!((a.module.as_str(), a.role), ("m.q_proj", Role::B));
        let a = adapter_name("m.q_proj.lora_magnitude_vector", true).unwrap();
        assert_eq!(a.role, Role::Magnitude);
        let a = adapter_name("m.q_proj.lora_magnitude_vector.other.weight", false).unwrap();
        assert_eq!((a.role, a.adapter.as_str()), (Role::Magnitude, "other"));
        let a = adapter_name("m.embed.lora_embedding_A.default", false).unwrap();
        assert_eq!((a.role, a.adapter.as_str()), (Role::EmbeddingA, "default"));
        assert!(matches!(
            adapter_name("m.q.lora_B.default.bias", false).unwrap().role,
            Role::Other(_)
        ));
        assert!(adapter_name("m.q_proj.base_layer.weight", false).is_none());
    }
}
