//! `ckpt inspect`: a description of a checkpoint, as a stable JSON document or a table.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::model::{Checkpoint, Encoding, Tensor};
use crate::pickle::Value;

/// The `--json` document. Field names and meanings are a stable contract (see docs/commands.md).
///
/// Tensors and their pieces are described as they are serialized (see [`Tensors`]), so a
/// checkpoint of millions of pieces is written out without its document ever being in memory.
#[derive(Debug, Serialize)]
pub(crate) struct Report<'a> {
    pub format: &'static str,
    pub state_dict_type: &'static str,
    pub world_size: Option<usize>,
    /// What the layout says of itself (DeepSpeed's ZeRO stage and tag), in the order it says it.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub details: Vec<Detail<'a>>,
    /// The finest way a tensor is cut: the number of pieces along each cut dim (`[4]` for FSDP over
    /// 4 ranks, `[2, 2]` for Shard(0),Shard(1) on a 2x2 mesh). DCP does not record the device
    /// mesh, so this is read off the pieces; null when no tensor is cut.
    pub mesh: Option<Vec<usize>>,
    pub tensor_count: usize,
    pub total_bytes: u64,
    /// Logical bytes per dtype code.
    pub bytes_per_dtype: BTreeMap<String, u64>,
    pub tensors: Tensors<'a>,
    pub non_tensors: Vec<ValueReport>,
    /// Tensors of a dtype ckpt does not support (not in `tensors`); absent when there are none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub unsupported: Vec<UnsupportedReport<'a>>,
    /// An FSDP1 LOCAL_STATE_DICT checkpoint read without `--shapes-from`; absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fsdp_local: Option<LocalReport<'a>>,
}

/// One thing a layout says of itself.
#[derive(Debug, Serialize)]
pub(crate) struct Detail<'a> {
    pub what: &'a str,
    pub value: &'a str,
}

/// What an FSDP1 LOCAL checkpoint lacks: its tensors are flat parameters, not the model's.
#[derive(Debug, Serialize)]
pub(crate) struct LocalReport<'a> {
    /// The `_flat_param` tensors, one per FSDP unit.
    pub flat_params: Vec<&'a str>,
    /// Always false: the files hold no parameter names or shapes.
    pub names_and_shapes: bool,
    pub hint: &'static str,
}

#[derive(Debug, Serialize)]
pub(crate) struct UnsupportedReport<'a> {
    pub name: &'a str,
    /// The dtype as the file names it: `torch.bits8`, `F4`.
    pub dtype: &'a str,
}

/// The selected tensors of a checkpoint, each described when it is serialized or iterated.
#[derive(Debug)]
pub(crate) struct Tensors<'a>(Vec<&'a Tensor>);

impl<'a> Tensors<'a> {
    pub(crate) fn iter(&self) -> impl Iterator<Item = TensorReport<'a>> + '_ {
        self.0.iter().map(|&t| TensorReport::of(t))
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl Serialize for Tensors<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.iter())
    }
}

#[derive(Debug, Serialize)]
pub(crate) struct TensorReport<'a> {
    pub name: &'a str,
    /// safetensors dtype code: `F32`, `BF16`, `F8_E4M3`, `BOOL`, ...
    pub dtype: String,
    pub shape: &'a [u64],
    pub bytes: u64,
    pub pieces: Pieces<'a>,
}

impl<'a> TensorReport<'a> {
    fn of(t: &'a Tensor) -> TensorReport<'a> {
        TensorReport {
            name: &t.name,
            dtype: t.dtype.to_string(),
            shape: &t.shape,
            bytes: t.nbytes().unwrap_or(u64::MAX),
            pieces: Pieces(t),
        }
    }
}

/// A tensor's pieces, each described when it is serialized.
#[derive(Debug)]
pub(crate) struct Pieces<'a>(&'a Tensor);

impl Pieces<'_> {
    pub(crate) fn len(&self) -> usize {
        self.0.pieces.len()
    }
}

impl Serialize for Pieces<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let elem = self.0.dtype.size() as u64;
        s.collect_seq(self.0.pieces.iter().map(|p| {
            let strides = p.strides();
            PieceReport {
                offsets: p.offsets(),
                sizes: p.sizes(),
                file: p.file().display().to_string(),
                byte_offset: p.offset(),
                byte_length: crate::model::numel(p.sizes()).unwrap_or(0) * elem,
                strides: (*strides != crate::model::contiguous_strides(p.sizes()))
                    .then_some(strides),
                encoding: match p.encoding() {
                    Encoding::Raw => None,
                    Encoding::Zstd { .. } => Some("zstd"),
                    Encoding::Deflate { .. } => Some("deflate"),
                    Encoding::Saved { .. } => Some("torch.save item"),
                    Encoding::Zeros => Some("zeros"),
                },
            }
        }))
    }
}

#[derive(Debug, Serialize)]
pub(crate) struct PieceReport<'a> {
    pub offsets: &'a [u64],
    pub sizes: &'a [u64],
    /// File relative to the checkpoint root.
    pub file: String,
    /// Byte offset of the first element in `file` (in the decompressed item for zstd items).
    pub byte_offset: u64,
    /// Logical bytes of the piece: its elements times the dtype size.
    pub byte_length: u64,
    /// Present for a non-contiguous view (torch.save), in elements.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub strides: Option<std::borrow::Cow<'a, [u64]>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub encoding: Option<&'static str>,
}

#[derive(Debug, Serialize)]
pub(crate) struct ValueReport {
    pub name: String,
    /// The value as JSON when it is plain data, else null.
    pub value: Option<serde_json::Value>,
    /// Size of its serialized form where it has one (DCP), else null.
    pub bytes: Option<u64>,
}

/// Describe `ckpt`, keeping only tensors and values whose name `keep` accepts.
pub(crate) fn report<'a>(ckpt: &'a Checkpoint, keep: &dyn Fn(&str) -> bool) -> Report<'a> {
    let tensors: Vec<&Tensor> = ckpt.tensors.iter().filter(|t| keep(&t.name)).collect();
    let mut bytes_per_dtype = BTreeMap::new();
    let mut total_bytes = 0u64;
    for t in &tensors {
        let bytes = t.nbytes().unwrap_or(u64::MAX);
        let sum = bytes_per_dtype.entry(t.dtype.to_string()).or_insert(0u64);
        // Shapes come from the checkpoint: a hostile one's byte counts overflow.
        *sum = sum.saturating_add(bytes);
        total_bytes = total_bytes.saturating_add(bytes);
    }
    let non_tensors = ckpt
        .values
        .iter()
        .filter(|v| keep(&v.name))
        .map(|v| ValueReport {
            name: v.name.clone(),
            value: v.value.as_ref().map(Value::to_json),
            bytes: v.raw.as_ref().map(|b| b.length),
        })
        .collect();
    let flat = ckpt.flat_params();
    let fsdp_local = (!flat.is_empty()).then(|| LocalReport {
        flat_params: flat.iter().map(|t| t.name.as_str()).collect(),
        names_and_shapes: false,
        hint: crate::model::SHAPES_HINT,
    });
    Report {
        format: ckpt.format.name(),
        state_dict_type: ckpt.state_dict_type().name(),
        world_size: ckpt.world_size,
        details: ckpt
            .details
            .iter()
            .map(|(what, value)| Detail { what, value })
            .collect(),
        mesh: inferred_mesh(ckpt),
        tensor_count: tensors.len(),
        total_bytes,
        bytes_per_dtype,
        tensors: Tensors(tensors),
        non_tensors,
        unsupported: ckpt
            .unsupported
            .iter()
            .filter(|u| keep(&u.name))
            .map(|u| UnsupportedReport {
                name: &u.name,
                dtype: &u.dtype,
            })
            .collect(),
        fsdp_local,
    }
}

/// The finest cut among tensors (most pieces; the most common one on a tie): small tensors show
/// only part of a mesh, the largest ones all of it (see [`Report::mesh`]).
fn inferred_mesh(ckpt: &Checkpoint) -> Option<Vec<usize>> {
    let mut counts: std::collections::BTreeMap<Vec<usize>, usize> = Default::default();
    for t in &ckpt.tensors {
        let cuts: Vec<usize> = (0..t.shape.len())
            .map(|d| {
                let starts: std::collections::BTreeSet<u64> = t
                    .pieces
                    .iter()
                    .filter_map(|p| p.offsets().get(d).copied())
                    .collect();
                starts.len()
            })
            .filter(|&n| n > 1)
            .collect();
        if !cuts.is_empty() {
            *counts.entry(cuts).or_default() += 1;
        }
    }
    counts
        .into_iter()
        .max_by_key(|(cut, n)| {
            (
                cut.iter().product::<usize>(),
                *n,
                std::cmp::Reverse(cut.clone()),
            )
        })
        .map(|(cut, _)| cut)
}

/// Human-readable bytes: `1.50 GiB`.
pub(crate) fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

/// The table `ckpt inspect` prints.
pub(crate) fn render(report: &Report) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let about = match report.format {
        "megatron-torch-dist" => {
            " (Megatron-core dist_checkpointing, torch_dist backend: DCP + common.pt)"
        }
        _ => "",
    };
    let _ = writeln!(s, "format:          {}{about}", report.format);
    let _ = writeln!(s, "state dict type: {}", report.state_dict_type);
    let ws = report.world_size.map_or("-".to_string(), |w| w.to_string());
    let _ = writeln!(s, "world size:      {ws}");
    for d in &report.details {
        let label = format!("{}:", d.what);
        let _ = writeln!(s, "{label:<16} {}", d.value);
    }
    if let Some(mesh) = &report.mesh {
        let cut: Vec<String> = mesh.iter().map(|n| n.to_string()).collect();
        // DCP does not record the mesh; per-rank DTensors do, and their pieces follow it.
        let why = if report.format.starts_with("dcp") {
            "; DCP does not record the mesh"
        } else {
            ""
        };
        let _ = writeln!(
            s,
            "mesh (inferred): {} (pieces per cut dim{why})",
            cut.join("x")
        );
    }
    let _ = writeln!(
        s,
        "tensors:         {} ({})",
        report.tensor_count,
        human_bytes(report.total_bytes)
    );
    let per: Vec<String> = report
        .bytes_per_dtype
        .iter()
        .map(|(d, b)| format!("{d} {}", human_bytes(*b)))
        .collect();
    let _ = writeln!(s, "by dtype:        {}", per.join(", "));
    let _ = writeln!(s, "non-tensors:     {}", report.non_tensors.len());
    if let Some(local) = &report.fsdp_local {
        let _ = writeln!(
            s,
            "FSDP1 LOCAL:     {} flat parameter{} (one per FSDP unit); the parameters' names and shapes are not in the files (with use_orig_params=True, the tensors named after parameters hold one rank's 1-D slice of each)\nhint: {}",
            local.flat_params.len(),
            if local.flat_params.len() == 1 { "" } else { "s" },
            local.hint
        );
    }
    if !report.tensors.is_empty() {
        let rows: Vec<[String; 5]> = report
            .tensors
            .iter()
            .map(|t| {
                [
                    t.name.to_string(),
                    t.dtype.clone(),
                    format!("{:?}", t.shape),
                    t.pieces.len().to_string(),
                    human_bytes(t.bytes),
                ]
            })
            .collect();
        let header = ["name", "dtype", "shape", "pieces", "bytes"].map(String::from);
        let mut widths = header.clone().map(|h| h.len());
        for row in &rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let _ = writeln!(s);
        for row in std::iter::once(&header).chain(&rows) {
            let _ = writeln!(
                s,
                "{:<w0$}  {:<w1$}  {:<w2$}  {:>w3$}  {:>w4$}",
                row[0],
                row[1],
                row[2],
                row[3],
                row[4],
                w0 = widths[0],
                w1 = widths[1],
                w2 = widths[2],
                w3 = widths[3],
                w4 = widths[4]
            );
        }
    }
    if !report.non_tensors.is_empty() {
        let _ = writeln!(s);
        for v in &report.non_tensors {
            let shown = v
                .value
                .as_ref()
                .map_or("<not plain data>".to_string(), |j| {
                    let text = j.to_string();
                    if text.chars().count() > 60 {
                        format!("{}...", text.chars().take(57).collect::<String>())
                    } else {
                        text
                    }
                });
            let _ = writeln!(s, "{}  {shown}", v.name);
        }
    }
    if !report.unsupported.is_empty() {
        let _ = writeln!(
            s,
            "\nunsupported dtypes (ckpt converts the rest with --exclude naming these):"
        );
        for u in &report.unsupported {
            let _ = writeln!(s, "{}  {}", u.name, u.dtype);
        }
    }
    s
}
