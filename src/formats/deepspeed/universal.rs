//! DeepSpeed's Universal Checkpoint (`ds_to_universal`'s output): one folder per parameter under
//! `zero/`, holding `fp32.pt`, `exp_avg.pt`, `exp_avg_sq.pt` and `step.pt`, each a whole tensor
//! (`{"param": tensor, "cat_dim": d}` from stages 1-2, the flat tensor itself from stage 3), and
//! `zero/optimizer_state.pt` with the optimizer's settings per group. Read with the same names as
//! a ZeRO save, every tensor one piece (a flat one viewed in its parameter's shape).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::files::Tag;
use super::{dict_items, key, shapes_of, StateFile};
use crate::error::{Error, Result};
use crate::geometry::numel;
use crate::layout::Listing;
use crate::model::{Checkpoint, Format, KeyPart, NonTensor, Pieces, Tensor};
use crate::pickle::Value;
use crate::storage;

/// Each parameter's shape, by name.
type Shapes = HashMap<String, Vec<u64>>;

/// The states `ds_to_universal` writes per parameter, and where each goes.
const STATES: [(&str, Option<&str>); 4] = [
    ("fp32", None),
    ("exp_avg", Some("exp_avg")),
    ("exp_avg_sq", Some("exp_avg_sq")),
    ("step", Some("step")),
];

/// Read the Universal Checkpoint in `tag.dir` (`zero` is its per-parameter folder).
pub(super) fn read(tag: &Tag, zero: &Path) -> Result<Checkpoint> {
    let (shapes, groups) = model_states(&tag.dir)?;
    let mut tensors = Vec::new();
    let mut optim = Vec::new();
    let mut values = Vec::new();
    let settings = optimizer_settings(zero, &groups)?;
    for dir in storage::listing(zero)?.into_iter().filter(|e| e.is_dir()) {
        let fqn = dir.name().to_string();
        let files = storage::listing(&dir.path)?;
        for (state, optim_name) in STATES {
            let Some(file) = files.iter().find(|e| e.name() == format!("{state}.pt")) else {
                continue;
            };
            let relative = PathBuf::from("zero").join(&fqn).join(format!("{state}.pt"));
            let f = StateFile::open_as(&file.path, relative)?;
            let at = if f.leaf(&key(&["param"])).is_some() {
                key(&["param"])
            } else {
                Vec::new()
            };
            let saved = f.tensor(&at)?;
            // Stage 3's files are flat: the parameter's shape comes from the model states.
            let shape = match shapes.get(&fqn) {
                Some(s) if saved.shape.len() == 1 && numel(s) == Some(saved.shape[0]) => s.clone(),
                _ => saved.shape.clone(),
            };
            let (dtype, pieces) = if shape != saved.shape {
                let flat = f.flat(&at)?;
                let mut pieces = Pieces::new(shape.len());
                flat.add(&mut pieces, &shape, 0, flat.len, 0)?;
                (flat.dtype, pieces)
            } else {
                let (dtype, _, pieces) = f.whole(&at)?;
                (dtype, pieces)
            };
            let (name, key_path) = match optim_name {
                None => (
                    format!("model.{fqn}"),
                    vec![KeyPart::Key("model".into()), KeyPart::Key(fqn.clone())],
                ),
                Some(s) => {
                    let flat = format!("state.{fqn}.{s}");
                    (
                        format!("optim.{flat}"),
                        vec![KeyPart::Key("optim".into()), KeyPart::Key(flat)],
                    )
                }
            };
            let t = Tensor {
                name,
                key_path,
                dtype,
                shape,
                pieces,
            };
            match optim_name {
                None => tensors.push(t),
                Some(_) => optim.push(t),
            }
        }
        if let Some(group) = settings.get(&fqn) {
            for (k, v) in group.iter() {
                let flat = format!("param_groups.{fqn}.{k}");
                values.push(NonTensor {
                    name: format!("optim.{flat}"),
                    key_path: vec![KeyPart::Key("optim".into()), KeyPart::Key(flat)],
                    value: Some(v.clone()),
                    raw: None,
                });
            }
        }
    }
    if tensors.is_empty() {
        return Err(Error::invalid("no `zero/<parameter>/fp32.pt` files here")
            .file(zero)
            .hint("the conversion did not finish, or this is not a Universal Checkpoint"));
    }
    tensors.extend(optim);
    Ok(Checkpoint {
        root: tag.dir.clone(),
        // Each parameter whole in its own files: nothing is left partitioned.
        format: Format::DeepSpeedZero { partitioned: false },
        world_size: None,
        tensors,
        values,
        unsupported: Vec::new(),
        details: vec![
            (
                "layout".into(),
                "Universal Checkpoint (ds_to_universal)".into(),
            ),
            ("tag".into(), tag.name.clone()),
        ],
    })
}

/// Each parameter's shape (stage 3's flat files need it) and the trainable parameters of each
/// group, from the model states beside `zero/`.
fn model_states(dir: &Path) -> Result<(Shapes, Vec<Vec<String>>)> {
    let Listing::Dir { entries, .. } = Listing::of(dir)? else {
        return Ok(Default::default());
    };
    let Some(states) = entries
        .iter()
        .find(|e| e.is_file() && e.name().ends_with("_model_states.pt"))
    else {
        return Ok(Default::default());
    };
    let f = StateFile::open(&states.path)?;
    let mut shapes = HashMap::new();
    let mut members = Vec::new();
    if let Some(Value::List(groups)) = f.value(&key(&["param_shapes"])) {
        for g in groups {
            let group = shapes_of(g).unwrap_or_default();
            members.push(group.iter().map(|(n, _)| n.clone()).collect());
            shapes.extend(group);
        }
    }
    for (k, leaf) in &f.archive.leaves {
        if let (
            [KeyPart::Key(section), KeyPart::Key(name)],
            crate::formats::torch_save::Leaf::Value(v),
        ) = (k.as_slice(), leaf)
        {
            if section == "frozen_param_shapes" {
                if let Some(shape) = Value::as_sizes(v) {
                    shapes.insert(name.clone(), shape);
                }
            }
        }
    }
    Ok((shapes, members))
}

/// Each parameter's optimizer settings from `zero/optimizer_state.pt`, whose group `g` holds the
/// parameters of the model states' group `g`.
fn optimizer_settings(
    zero: &Path,
    members: &[Vec<String>],
) -> Result<HashMap<String, Vec<(String, Value)>>> {
    let path = zero.join("optimizer_state.pt");
    if !storage::is_file(&path) {
        return Ok(HashMap::new());
    }
    let f = StateFile::open(&path)?;
    let mut out = HashMap::new();
    let Some(Value::List(groups)) = f.value(&key(&["param_groups"])) else {
        return Ok(out);
    };
    for (group, names) in groups.iter().zip(members) {
        let Some(items) = dict_items(group) else {
            continue;
        };
        let settings: Vec<(String, Value)> = items
            .iter()
            .filter_map(|(k, v)| Some((k.as_str()?.to_string(), v.clone())))
            .filter(|(k, _)| k != "params")
            .collect();
        for name in names {
            out.insert(name.clone(), settings.clone());
        }
    }
    Ok(out)
}
