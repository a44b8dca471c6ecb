//! What `ckpt inspect --hf-config` shows of an export before it is run: each source tensor's
//! Hugging Face name and view, and what is left out and why, as a table or as JSON.

use serde::Serialize;

use super::views::ViewKind;
use super::Mapping;

/// The stable JSON document of a mapping.
#[derive(Serialize)]
pub(crate) struct Report<'a> {
    pub architecture: &'a str,
    /// `hugging-face`, `torchtitan`, `torchtitan-0.2`.
    pub naming: &'a str,
    /// The app-state prefix of the model's names (empty at the top level).
    pub prefix: &'a str,
    pub mapping: Vec<Row<'a>>,
    pub left_out: Vec<LeftOutRow<'a>>,
}

#[derive(Serialize)]
pub(crate) struct Row<'a> {
    pub source: &'a str,
    pub target: &'a str,
    /// The view, after `unstack N, ` when the target is index N of the source's leading axis
    /// (`unstack N M, ` of two).
    pub view: String,
    /// The index of the leading axis an `unstack` takes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<u64>,
    /// The indices of the leading axes, where an `unstack` takes more than one (a layer and an
    /// expert of Megatron's layer- and expert-stacked experts).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub indices: Option<&'a [u64]>,
}

#[derive(Serialize)]
pub(crate) struct LeftOutRow<'a> {
    pub name: &'a str,
    pub why: &'a str,
}

pub(crate) fn report(m: &Mapping) -> Report<'_> {
    Report {
        architecture: m.architecture,
        naming: m.naming.describe(),
        prefix: &m.prefix,
        mapping: m
            .placed
            .iter()
            .map(|p| Row {
                source: &p.source_name,
                target: &p.target,
                view: {
                    let at: Vec<String> = p.stack.iter().map(u64::to_string).collect();
                    match (p.stack.is_empty(), p.view == ViewKind::Rename) {
                        (true, _) => p.view.describe().to_string(),
                        (false, true) => format!("unstack {}", at.join(" ")),
                        (false, false) => {
                            format!("unstack {}, {}", at.join(" "), p.view.describe())
                        }
                    }
                },
                index: match p.stack[..] {
                    [i] => Some(i),
                    _ => None,
                },
                indices: (p.stack.len() > 1).then_some(&p.stack[..]),
            })
            .collect(),
        left_out: m
            .left_out
            .iter()
            .map(|l| LeftOutRow {
                name: &l.name,
                why: l.why,
            })
            .collect(),
    }
}

/// The report as a table for a terminal.
pub(crate) fn render(r: &Report) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let under = if r.prefix.is_empty() {
        "at the top level".to_string()
    } else {
        format!("under `{}`", r.prefix)
    };
    let _ = writeln!(
        s,
        "{} names {under} -> {}: {} tensors, {} left out",
        r.naming,
        r.architecture,
        r.mapping.len(),
        r.left_out.len()
    );
    let width = r.mapping.iter().map(|m| m.source.len()).max().unwrap_or(0);
    for m in &r.mapping {
        let view = match m.view.as_str() {
            "rename" => String::new(),
            view => format!("  [{view}]"),
        };
        let _ = writeln!(s, "  {:width$}  ->  {}{view}", m.source, m.target);
    }
    if !r.left_out.is_empty() {
        let _ = writeln!(s, "left out:");
        let width = r.left_out.iter().map(|l| l.name.len()).max().unwrap_or(0);
        for l in &r.left_out {
            let _ = writeln!(s, "  {:width$}  {}", l.name, l.why);
        }
    }
    s
}
