//! A pass over a pickle's opcodes that finds which memo entries are ever fetched, without
//! building anything.
//!
//! Pickles memoize nearly everything they write (protocol 4 puts every object in the memo), but a
//! large `.metadata` fetches back only a few entries: repeated strings, class globals, a shared
//! layout object. Knowing which, the reader can drop the nodes of a consumed batch (see
//! [`super::Consumer`]) and keep just those few.

use std::collections::HashSet;

use super::opcodes::{self as op, uint};

/// Memo indices that some `GET`, `BINGET` or `LONG_BINGET` reads, or `None` when the pickle has
/// an opcode this pass does not know how to skip (the reader then keeps every node).
pub(super) fn fetched_memo(bytes: &[u8]) -> Option<HashSet<u64>> {
    let mut fetched = HashSet::new();
    // Mirrors `Memo`: indices 0, 1, 2, ... count up densely; any other index is kept apart.
    let mut dense = 0u64;
    let mut sparse: HashSet<u64> = HashSet::new();
    let put = |index: u64, dense: &mut u64, sparse: &mut HashSet<u64>| {
        if index == *dense {
            sparse.remove(&index);
            *dense += 1;
        } else if index > *dense {
            sparse.insert(index);
        }
    };
    let mut at = 0usize;
    loop {
        let opcode = *bytes.get(at)?;
        let arg = op::argument(bytes, at)?;
        at += 1 + arg.len();
        match opcode {
            op::STOP => return Some(fetched),
            op::MEMOIZE => {
                let index = dense + sparse.len() as u64;
                put(index, &mut dense, &mut sparse);
            }
            op::BINPUT | op::LONG_BINPUT => put(uint(arg), &mut dense, &mut sparse),
            op::PUT => put(decimal(arg)?, &mut dense, &mut sparse),
            op::BINGET | op::LONG_BINGET => {
                fetched.insert(uint(arg));
            }
            op::GET => {
                fetched.insert(decimal(arg)?);
            }
            _ => {}
        }
    }
}

/// The memo index of a `PUT` or `GET` line; trimming drops its `\n` too.
fn decimal(line: &[u8]) -> Option<u64> {
    std::str::from_utf8(line).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::op::*;
    use super::*;

    #[test]
    fn finds_the_fetched_entries_of_each_put_kind() {
        // MEMOIZE x2 (0, 1), BINPUT 5, LONG_BINPUT 6, PUT 7; fetches of 1, 5 (twice) and 7.
        let mut p = vec![PROTO, 4, NONE, MEMOIZE, NONE, MEMOIZE, NONE, BINPUT, 5];
        p.extend_from_slice(&[NONE, LONG_BINPUT, 6, 0, 0, 0, NONE, PUT]);
        p.extend_from_slice(b"7\n");
        p.extend_from_slice(&[BINGET, 1, LONG_BINGET, 5, 0, 0, 0, BINGET, 5, GET]);
        p.extend_from_slice(b"7\n");
        p.push(STOP);
        let fetched = fetched_memo(&p).unwrap();
        let mut got: Vec<u64> = fetched.into_iter().collect();
        got.sort();
        assert_eq!(got, vec![1, 5, 7]);
    }

    #[test]
    fn lengths_are_skipped_and_unknown_opcodes_give_up() {
        // A string whose bytes look like a BINGET is skipped whole.
        let p = [PROTO, 4, SHORT_BINUNICODE, 2, BINGET, 9, STOP];
        assert_eq!(fetched_memo(&p).unwrap().len(), 0);
        // `OBJ`, which the table does not name.
        assert!(fetched_memo(&[PROTO, 4, b'o', STOP]).is_none());
        assert!(
            fetched_memo(&[PROTO, 4, SHORT_BINUNICODE, 9, b'a']).is_none(),
            "truncated"
        );
    }
}
