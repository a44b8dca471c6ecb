//! The comparison of ckpt's safetensors header reader with the reference, the `safetensors` crate,
//! on one file, shared by `tests/safetensors_oracle.rs` and the `safetensors_oracle` fuzz target.
//! Here is the one list of cases where ckpt refuses on purpose what the reference reads.
// The test and the fuzz target each use a part.
#![allow(dead_code)]

use std::collections::HashMap;

use ckpt::formats::safetensors::Header;
use serde::de::{Deserialize, Deserializer, IgnoredAny, MapAccess, Visitor};

/// How ckpt's reading of a file compares with the reference's.
pub enum Verdict {
    BothRead,
    BothRefused,
    /// ckpt refuses a file the reference reads, for a documented reason.
    Excused(&'static str),
    /// A disagreement, described with the file.
    Disagree(String),
}

/// Compare ckpt's result on `file` with the reference's.
pub fn compare<E: std::fmt::Display>(ours: Result<Header, E>, file: &[u8]) -> Verdict {
    match (ours, safetensors::SafeTensors::read_metadata(file)) {
        (Err(_), Err(_)) => Verdict::BothRefused,
        (Ok(header), Ok((n, meta))) => match same_reading(&header, n, &meta) {
            Ok(()) => Verdict::BothRead,
            Err(e) => Verdict::Disagree(format!("both read it, differently: {e}\n{}", show(file))),
        },
        (Ok(_), Err(e)) => Verdict::Disagree(format!(
            "ckpt reads a file the reference refuses ({e})\n{}",
            show(file)
        )),
        (Err(ours), Ok((_, meta))) => match excuse(file, &meta) {
            Some(why) => Verdict::Excused(why),
            None => Verdict::Disagree(format!(
                "ckpt refuses a file the reference reads: {ours}\n{}",
                show(file)
            )),
        },
    }
}

/// Files the reference reads and ckpt refuses on purpose, each with why. docs/guarantees.md
/// lists the same cases; each detector looks at the header itself, not at ckpt's error.
pub const STRICTER: &[(&str, Detector)] = &[
    (
        // The crate keeps the last entry of a repeated name and ignores the others, whose byte
        // ranges still have to tile the buffer: two descriptions of one tensor, and a reader
        // that picks one silently may pick the wrong one.
        "a tensor name appears twice in the header",
        |m| has_duplicate(m.0.iter().map(|(k, _)| k)),
    ),
    (
        // The crate keeps the last value of a repeated `__metadata__` key. Some keys decide how
        // the tensors are read (`DCP_SHARDING_INFO` places each shard of a DCP checkpoint), so an
        // ambiguous one is refused rather than guessed.
        "a `__metadata__` key appears twice",
        |m| {
            m.metadata_keys()
                .is_some_and(|keys| has_duplicate(keys.iter()))
        },
    ),
];

/// Whether a case of [`STRICTER`] applies to a header.
pub type Detector = fn(&Members) -> bool;

/// Sub-byte dtypes safetensors 0.8 reads and ckpt keeps aside by name (a run refuses them unless
/// excluded), so its tensors and the crate's differ by design. The generator never writes them; a
/// mutation that happens to is skipped.
pub const NOT_YET: &[&str] = &["F4", "F6_E2M3", "F6_E3M2"];

/// The header's members, duplicates kept, as a detector of [`STRICTER`] sees them: each name,
/// with the names inside it when its value is an object.
pub struct Members(pub Vec<(String, Option<Vec<String>>)>);

impl Members {
    fn metadata_keys(&self) -> Option<&Vec<String>> {
        self.0
            .iter()
            .find(|(k, _)| k == "__metadata__")
            .and_then(|(_, v)| v.as_ref())
    }
}

/// An object's member names, duplicates kept; `None` for any other value.
struct Keys(Option<Vec<String>>);

impl<'de> Deserialize<'de> for Keys {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Keys;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Keys, A::Error> {
                let mut out = Vec::new();
                while let Some(k) = map.next_key::<String>()? {
                    map.next_value::<IgnoredAny>()?;
                    out.push(k);
                }
                Ok(Keys(Some(out)))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Keys, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Keys(None))
            }
            fn visit_unit<E>(self) -> Result<Keys, E> {
                Ok(Keys(None))
            }
            fn visit_bool<E>(self, _: bool) -> Result<Keys, E> {
                Ok(Keys(None))
            }
            fn visit_i64<E>(self, _: i64) -> Result<Keys, E> {
                Ok(Keys(None))
            }
            fn visit_u64<E>(self, _: u64) -> Result<Keys, E> {
                Ok(Keys(None))
            }
            fn visit_f64<E>(self, _: f64) -> Result<Keys, E> {
                Ok(Keys(None))
            }
            fn visit_str<E>(self, _: &str) -> Result<Keys, E> {
                Ok(Keys(None))
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for Members {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Members;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Members, A::Error> {
                let mut out = Vec::new();
                while let Some(k) = map.next_key::<String>()? {
                    out.push((k, map.next_value::<Keys>()?.0));
                }
                Ok(Members(out))
            }
        }
        d.deserialize_map(V)
    }
}

/// The top-level members of a header the reference accepted.
pub fn top_members(file: &[u8]) -> Option<Members> {
    let n = usize::try_from(u64::from_le_bytes(file.get(..8)?.try_into().ok()?)).ok()?;
    let text = std::str::from_utf8(file.get(8..8 + n)?).ok()?;
    serde_json::from_str(text).ok()
}

fn has_duplicate<'a>(keys: impl Iterator<Item = &'a String>) -> bool {
    let mut seen = std::collections::HashSet::new();
    keys.into_iter().any(|k| !seen.insert(k))
}

/// Which documented exception, if any, excuses ckpt refusing a file the reference reads.
fn excuse(file: &[u8], meta: &safetensors::tensor::Metadata) -> Option<&'static str> {
    let dtypes: Vec<String> = meta
        .tensors()
        .values()
        .map(|t| format!("{:?}", t.dtype))
        .collect();
    if dtypes.iter().any(|d| NOT_YET.contains(&d.as_str())) {
        return Some("a sub-byte dtype ckpt keeps aside by name");
    }
    let members = top_members(file)?;
    STRICTER
        .iter()
        .find(|(_, applies)| applies(&members))
        .map(|(why, _)| *why)
}

fn show(file: &[u8]) -> String {
    format!(
        "{} bytes, starting {:?}",
        file.len(),
        String::from_utf8_lossy(&file[..file.len().min(600)])
    )
}

/// Each tensor's dtype, shape and data offsets, by name.
type Reading = HashMap<String, (String, Vec<u64>, (u64, u64))>;

/// Both readers' view of an accepted file: data start, every tensor, the metadata.
fn same_reading(
    ours: &Header,
    n: usize,
    theirs: &safetensors::tensor::Metadata,
) -> Result<(), String> {
    if ours.data_start != 8 + n as u64 {
        return Err(format!("data starts at {} vs {}", ours.data_start, 8 + n));
    }
    let want: Reading = theirs
        .tensors()
        .into_iter()
        .map(|(name, t)| {
            let shape = t.shape.iter().map(|&d| d as u64).collect();
            let (b, e) = t.data_offsets;
            (
                name,
                (format!("{:?}", t.dtype), shape, (b as u64, e as u64)),
            )
        })
        .collect();
    let got: Reading = ours
        .tensors
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                (
                    t.dtype.safetensors_code().unwrap_or("?").to_string(),
                    t.shape.clone(),
                    (t.begin, t.end),
                ),
            )
        })
        .collect();
    if got.len() != ours.tensors.len() || got != want {
        return Err(format!("tensors {got:?} vs {want:?}"));
    }
    let want_meta = theirs.metadata().clone().unwrap_or_default();
    let got_meta: HashMap<String, String> = ours.metadata.iter().cloned().collect();
    if got_meta.len() != ours.metadata.len() || got_meta != want_meta.into_iter().collect() {
        return Err(format!(
            "metadata {:?} vs {:?}",
            ours.metadata,
            theirs.metadata()
        ));
    }
    Ok(())
}
