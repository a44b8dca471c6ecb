//! PEFT's `adapter_config.json`, as far as merging a LoRA adapter needs it, and PEFT's matching of
//! `rank_pattern` / `alpha_pattern` keys to module names.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{Error, Result};
use crate::storage;

/// The file PEFT's `save_pretrained` writes the configuration to.
pub(crate) const CONFIG_FILE: &str = "adapter_config.json";
/// The file PEFT's `save_pretrained` writes the adapter's tensors to.
pub(crate) const ADAPTER_FILE: &str = "adapter_model.safetensors";

/// A LoRA adapter's configuration.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct LoraConfig {
    /// `r`: the rank of every module not in `rank_pattern`.
    pub r: u64,
    /// `lora_alpha`.
    pub alpha: f64,
    /// `use_rslora`: scale by `alpha / sqrt(r)` rather than `alpha / r`.
    pub use_rslora: bool,
    /// `fan_in_fan_out`: the base weights are stored `[in, out]` (GPT-2's `Conv1D`).
    pub fan_in_fan_out: bool,
    /// `use_dora`: each output row is rescaled to the learned magnitude.
    pub use_dora: bool,
    /// `rank_pattern`, in the file's order (PEFT takes the first key that matches).
    pub rank_pattern: Vec<(String, u64)>,
    /// `alpha_pattern`, in the file's order.
    pub alpha_pattern: Vec<(String, f64)>,
    /// `lora_bias`: the adapter trains a bias of its own, which ckpt does not merge.
    pub lora_bias: bool,
}

impl LoraConfig {
    /// Parse the text of an `adapter_config.json`.
    pub(crate) fn parse(text: &[u8]) -> Result<LoraConfig> {
        let v: Value = serde_json::from_slice(text)
            .map_err(|e| Error::invalid(format!("not a PEFT adapter config: {e}")))?;
        let obj = v
            .as_object()
            .ok_or_else(|| Error::invalid("not a PEFT adapter config: not a JSON object"))?;
        match obj.get("peft_type").and_then(Value::as_str) {
            Some("LORA") => {}
            Some(other) => {
                return Err(Error::invalid(format!(
                    "the adapter is of PEFT type `{other}`; ckpt merges only LORA adapters"
                )))
            }
            None => return Err(Error::invalid("the adapter config has no `peft_type`")),
        }
        let r = obj
            .get("r")
            .and_then(Value::as_u64)
            .filter(|&r| r > 0)
            .ok_or_else(|| Error::invalid("the adapter config has no positive integer `r`"))?;
        let alpha = match obj.get("lora_alpha") {
            None | Some(Value::Null) => 8.0,
            Some(v) => v.as_f64().ok_or_else(|| {
                Error::invalid("`lora_alpha` in the adapter config is not a number")
            })?,
        };
        let flag = |key: &str| obj.get(key).and_then(Value::as_bool).unwrap_or(false);
        let pattern = |key: &str| -> Result<Vec<(String, f64)>> {
            match obj.get(key) {
                None | Some(Value::Null) => Ok(Vec::new()),
                Some(Value::Object(m)) => m
                    .iter()
                    .map(|(k, v)| {
                        let n = v.as_f64().ok_or_else(|| {
                            Error::invalid(format!(
                                "`{key}` in the adapter config maps `{k}` to a non-number"
                            ))
                        })?;
                        Ok((k.clone(), n))
                    })
                    .collect(),
                Some(_) => Err(Error::invalid(format!(
                    "`{key}` in the adapter config is not an object"
                ))),
            }
        };
        let rank_pattern = pattern("rank_pattern")?
            .into_iter()
            .map(|(k, n)| {
                if n >= 1.0 && n.fract() == 0.0 {
                    Ok((k, n as u64))
                } else {
                    Err(Error::invalid(format!(
                        "`rank_pattern` in the adapter config gives `{k}` the rank {n}"
                    )))
                }
            })
            .collect::<Result<_>>()?;
        // Each pattern key is a regular expression to PEFT; a bad one fails here, not per module.
        let alpha_pattern = pattern("alpha_pattern")?;
        let config = LoraConfig {
            r,
            alpha,
            use_rslora: flag("use_rslora"),
            fan_in_fan_out: flag("fan_in_fan_out"),
            use_dora: flag("use_dora"),
            rank_pattern,
            alpha_pattern,
            lora_bias: flag("lora_bias"),
        };
        for key in config
            .rank_pattern
            .iter()
            .map(|(k, _)| k)
            .chain(config.alpha_pattern.iter().map(|(k, _)| k))
        {
            pattern_regex(key)?;
        }
        Ok(config)
    }

    /// The rank and alpha of module `module` (its name in the base model, as PEFT's
    /// `named_modules()` gives it).
    pub(crate) fn rank_alpha(&self, module: &str) -> (u64, f64) {
        let r = pattern_value(&self.rank_pattern, module).unwrap_or(self.r);
        let alpha = pattern_value(&self.alpha_pattern, module).unwrap_or(self.alpha);
        (r, alpha)
    }

    /// PEFT's `scaling` for a module of rank `r` and alpha `alpha`.
    pub(crate) fn scaling(&self, r: u64, alpha: f64) -> f64 {
        if self.use_rslora {
            alpha / (r as f64).sqrt()
        } else {
            alpha / r as f64
        }
    }
}

/// Where a `--merge-lora` argument points: the config, and the adapter's own tensors when the
/// directory holds them.
#[derive(Clone, Debug)]
pub(crate) struct ConfigLocation {
    pub config: PathBuf,
    pub adapter_file: Option<PathBuf>,
    /// The directory's name: PEFT saves an adapter other than `default` in a subdirectory named
    /// after it.
    pub dir_name: Option<String>,
}

/// Find the config at `path`: the file itself or `adapter_config.json` in the directory.
pub(crate) fn locate(path: &Path) -> Result<ConfigLocation> {
    // Through storage: an adapter in an object store serves as well.
    let (config, dir) = if storage::is_dir(path) {
        (path.join(CONFIG_FILE), path.to_path_buf())
    } else {
        let dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
        (path.to_path_buf(), dir)
    };
    if !storage::is_file(&config) {
        return Err(
            Error::usage(format!("`{}` does not exist", config.display())).hint(
                "--merge-lora takes PEFT's adapter_config.json or the directory that holds it",
            ),
        );
    }
    let adapter_file = Some(dir.join(ADAPTER_FILE)).filter(|p| storage::is_file(p));
    let dir_name = storage::absolute(&dir)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned());
    Ok(ConfigLocation {
        config,
        adapter_file,
        dir_name,
    })
}

/// Read and parse the config at `path` (a file or a directory holding one).
pub(crate) fn read(path: &Path) -> Result<(LoraConfig, ConfigLocation)> {
    let loc = locate(path)?;
    let text = storage::read(&loc.config)?;
    let config = LoraConfig::parse(&text).map_err(|e| e.file(&loc.config))?;
    Ok((config, loc))
}

/// PEFT's `get_pattern_key`: the first key `k` for which `re.match(rf"(.*\.)?({k})$", module)`.
pub(crate) fn pattern_key<'a>(
    keys: impl IntoIterator<Item = &'a str>,
    module: &str,
) -> Option<&'a str> {
    keys.into_iter()
        .find(|k| pattern_regex(k).is_ok_and(|re| re.is_match(module)))
}

fn pattern_value<T: Copy>(pattern: &[(String, T)], module: &str) -> Option<T> {
    let key = pattern_key(pattern.iter().map(|(k, _)| k.as_str()), module)?;
    pattern.iter().find(|(k, _)| k == key).map(|(_, v)| *v)
}

fn pattern_regex(key: &str) -> Result<regex::Regex> {
    regex::Regex::new(&format!(r"^(?:.*\.)?(?:{key})$")).map_err(|e| {
        Error::invalid(format!(
            "the pattern `{key}` in the adapter config is not a regular expression ckpt reads: {e}"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: &str) -> LoraConfig {
        let text = format!(r#"{{"peft_type": "LORA", "r": 8, "lora_alpha": 16{extra}}}"#);
        LoraConfig::parse(text.as_bytes()).unwrap()
    }

    #[test]
    fn scaling_is_alpha_over_r_or_its_root() {
        let c = config("");
        assert_eq!(c.rank_alpha("model.q_proj"), (8, 16.0));
        assert_eq!(c.scaling(8, 16.0), 2.0);
        let c = config(r#", "use_rslora": true"#);
        assert_eq!(c.scaling(16, 16.0), 4.0);
    }

    #[test]
    fn patterns_match_as_peft_matches_them() {
        let c = config(
            r#", "rank_pattern": {"q_proj": 4, "layers.1.self_attn.v_proj": 2, "^model.layers.2.*k_proj": 3},
                "alpha_pattern": {"v_proj": 32}"#,
        );
        // A key matches a whole trailing run of dotted parts.
        assert_eq!(c.rank_alpha("model.layers.0.self_attn.q_proj"), (4, 16.0));
        assert_eq!(c.rank_alpha("model.layers.0.self_attn.xq_proj"), (8, 16.0));
        assert_eq!(c.rank_alpha("model.layers.1.self_attn.v_proj"), (2, 32.0));
        assert_eq!(c.rank_alpha("model.layers.0.self_attn.v_proj"), (8, 32.0));
        // A regular expression key, anchored at the start as `re.match` is.
        assert_eq!(c.rank_alpha("model.layers.2.self_attn.k_proj"), (3, 16.0));
        assert_eq!(c.rank_alpha("model.layers.3.self_attn.k_proj"), (8, 16.0));
        // The first key in the file's order wins.
        let c = config(r#", "rank_pattern": {"v_proj": 4, "self_attn.v_proj": 2}"#);
        assert_eq!(c.rank_alpha("m.self_attn.v_proj"), (4, 16.0));
    }

    #[test]
    fn refuses_other_peft_types_and_bad_values() {
        let e = LoraConfig::parse(br#"{"peft_type": "IA3", "r": 8}"#).unwrap_err();
        assert!(e.to_string().contains("`IA3`"), "{e}");
        assert!(LoraConfig::parse(br#"{"peft_type": "LORA", "r": 0}"#).is_err());
        assert!(
            LoraConfig::parse(br#"{"peft_type": "LORA", "r": 4, "rank_pattern": {"q": 1.5}}"#)
                .is_err()
        );
        assert!(
            LoraConfig::parse(br#"{"peft_type": "LORA", "r": 4, "rank_pattern": {"(": 2}}"#)
                .is_err()
        );
        assert!(LoraConfig::parse(b"[]").is_err());
    }
}
