//! Choosing and renaming entries before planning: `--include`, `--exclude`, `--strip-prefix`.
//! Tensors of dtypes ckpt cannot write are checked once the selection is made, so one left out
//! never stops a run.

use std::collections::BTreeSet;

use globset::{Glob, GlobSet, GlobSetBuilder};

use crate::error::{Error, Result};
use crate::model::Checkpoint;

/// Which entries to keep and how to rename them.
#[derive(Clone, Debug, Default)]
pub(crate) struct Selection {
    include: Option<GlobSet>,
    exclude: Option<GlobSet>,
    strip_prefixes: Vec<String>,
}

impl Selection {
    /// Globs match whole names (`*` crosses dots: `model.*.bias` matches `model.layers.0.bias`).
    pub(crate) fn new(
        include: &[String],
        exclude: &[String],
        strip_prefixes: &[String],
    ) -> Result<Selection> {
        Ok(Selection {
            include: glob_set(include)?,
            exclude: glob_set(exclude)?,
            strip_prefixes: strip_prefixes.to_vec(),
        })
    }

    /// True when `name` passes the include and exclude globs.
    pub(crate) fn keeps(&self, name: &str) -> bool {
        self.include.as_ref().is_none_or(|g| g.is_match(name))
            && !self.exclude.as_ref().is_some_and(|g| g.is_match(name))
    }

    fn rename(&self, name: &str) -> String {
        for p in &self.strip_prefixes {
            if let Some(rest) = name.strip_prefix(p.as_str()) {
                if !rest.is_empty() {
                    return rest.to_string();
                }
            }
        }
        name.to_string()
    }

    /// Apply to a checkpoint. Renamed entries lose their nesting (they become top-level keys).
    /// Tensors of unsupported dtypes are selected like the others, so that one left out never
    /// stops a run ([`Checkpoint::check_supported`] refuses those that stay).
    pub(crate) fn apply(&self, mut ckpt: Checkpoint) -> Result<Checkpoint> {
        ckpt.tensors.retain(|t| self.keeps(&t.name));
        ckpt.values.retain(|v| self.keeps(&v.name));
        ckpt.unsupported.retain(|u| self.keeps(&u.name));
        if !self.strip_prefixes.is_empty() {
            for t in &mut ckpt.tensors {
                let new = self.rename(&t.name);
                if new != t.name {
                    t.name = new;
                    t.key_path.clear();
                }
            }
            for v in &mut ckpt.values {
                let new = self.rename(&v.name);
                if new != v.name {
                    v.name = new;
                    v.key_path.clear();
                }
            }
        }
        let mut seen = BTreeSet::new();
        for name in ckpt
            .tensors
            .iter()
            .map(|t| &t.name)
            .chain(ckpt.values.iter().map(|v| &v.name))
        {
            if !seen.insert(name.clone()) {
                return Err(
                    Error::usage(format!("two entries would both be called `{name}`"))
                        .hint("use a longer --strip-prefix, or --exclude one of them"),
                );
            }
        }
        Ok(ckpt)
    }
}

impl super::Step for Selection {
    fn apply(&self, ckpt: Checkpoint, _: &mut super::Report) -> Result<Checkpoint> {
        let ckpt = Selection::apply(self, ckpt)?;
        ckpt.check_supported()?;
        Ok(ckpt)
    }
}

fn glob_set(patterns: &[String]) -> Result<Option<GlobSet>> {
    if patterns.is_empty() {
        return Ok(None);
    }
    let mut b = GlobSetBuilder::new();
    for p in patterns {
        let glob = Glob::new(p).map_err(|e| Error::usage(format!("bad glob `{p}`: {e}")))?;
        b.add(glob);
    }
    b.build()
        .map(Some)
        .map_err(|e| Error::usage(format!("bad glob: {e}")))
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::model::{Format, Unsupported};

    fn with_unsupported(names: &[&str]) -> Checkpoint {
        Checkpoint {
            root: PathBuf::from("."),
            format: Format::TorchSave,
            world_size: None,
            tensors: Vec::new(),
            values: Vec::new(),
            unsupported: names
                .iter()
                .map(|n| Unsupported {
                    name: n.to_string(),
                    dtype: "torch.bits8".into(),
                    file: PathBuf::from("m.pt"),
                })
                .collect(),
            details: Vec::new(),
        }
    }

    #[test]
    fn unsupported_tensors_are_selected_before_they_are_refused() {
        let ckpt = with_unsupported(&["model.packed", "model.scales"]);
        let err = ckpt.check_supported().unwrap_err();
        assert_eq!(err.tensor.as_deref(), Some("model.packed"));
        assert!(err.hint.unwrap().starts_with("2 tensors"));

        let sel = Selection::new(&[], &["model.packed".into()], &[]).unwrap();
        let left = sel.apply(ckpt.clone()).unwrap();
        let err = left.check_supported().unwrap_err();
        assert_eq!(err.tensor.as_deref(), Some("model.scales"));
        assert!(err.hint.unwrap().contains("--exclude 'model.scales'"));

        let sel = Selection::new(&["other.*".into()], &[], &["model.".into()]).unwrap();
        assert!(sel.apply(ckpt).unwrap().check_supported().is_ok());
    }
}
