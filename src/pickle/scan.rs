//! A pass over a pickle's opcodes that finds which memo entries are ever fetched, without
//! building anything.
//!
//! Pickles memoize nearly everything they write (protocol 4 puts every object in the memo), but a
//! large `.metadata` fetches back only a few entries: repeated strings, class globals, a shared
//! layout object. Knowing which, the reader can drop the nodes of a consumed batch (see
//! [`super::Consumer`]) and keep just those few.

use std::collections::HashSet;

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
    let mut pos = 0usize;
    let take = |pos: &mut usize, n: usize| -> Option<&[u8]> {
        let end = pos.checked_add(n)?;
        let out = bytes.get(*pos..end)?;
        *pos = end;
        Some(out)
    };
    let uint = |b: &[u8]| {
        b.iter()
            .rev()
            .fold(0u64, |acc, &x| (acc << 8) | u64::from(x))
    };
    let line = |pos: &mut usize| -> Option<&[u8]> {
        let rest = bytes.get(*pos..)?;
        let n = rest.iter().position(|&b| b == b'\n')?;
        *pos += n + 1;
        rest.get(..n)
    };
    loop {
        let op = *bytes.get(pos)?;
        pos += 1;
        match op {
            // STOP
            b'.' => return Some(fetched),
            // No argument.
            b'(' | b'0' | b'1' | b'2' | b'N' | b'Q' | b'R' | b'a' | b'b' | b'd' | b'}' | b'e'
            | b'l' | b']' | b's' | b't' | b')' | b'u' | 0x85 | 0x86 | 0x87 | 0x88 | 0x89 | 0x81
            | 0x92 | 0x8f | 0x90 | 0x91 | 0x93 => {}
            // MEMOIZE
            0x94 => {
                let index = dense + sparse.len() as u64;
                put(index, &mut dense, &mut sparse);
            }
            // PROTO, BININT1
            0x80 | b'K' => {
                take(&mut pos, 1)?;
            }
            // BININT2
            b'M' => {
                take(&mut pos, 2)?;
            }
            // BININT
            b'J' => {
                take(&mut pos, 4)?;
            }
            // BINFLOAT, FRAME
            b'G' | 0x95 => {
                take(&mut pos, 8)?;
            }
            // SHORT_BINSTRING, SHORT_BINBYTES, SHORT_BINUNICODE, LONG1: 1-byte length
            b'U' | b'C' | 0x8c | 0x8a => {
                let n = uint(take(&mut pos, 1)?);
                take(&mut pos, usize::try_from(n).ok()?)?;
            }
            // BINSTRING, BINUNICODE, BINBYTES, LONG4: 4-byte length
            b'T' | b'X' | b'B' | 0x8b => {
                let n = uint(take(&mut pos, 4)?);
                take(&mut pos, usize::try_from(n).ok()?)?;
            }
            // BINUNICODE8, BINBYTES8, BYTEARRAY8: 8-byte length
            0x8d | 0x8e | 0x96 => {
                let n = uint(take(&mut pos, 8)?);
                take(&mut pos, usize::try_from(n).ok()?)?;
            }
            // INT, LONG, FLOAT, STRING, UNICODE, PERSID: one line
            b'I' | b'L' | b'F' | b'S' | b'V' | b'P' => {
                line(&mut pos)?;
            }
            // GLOBAL: two lines
            b'c' => {
                line(&mut pos)?;
                line(&mut pos)?;
            }
            // BINPUT, LONG_BINPUT, PUT
            b'q' => put(uint(take(&mut pos, 1)?), &mut dense, &mut sparse),
            b'r' => put(uint(take(&mut pos, 4)?), &mut dense, &mut sparse),
            b'p' => put(decimal(line(&mut pos)?)?, &mut dense, &mut sparse),
            // BINGET, LONG_BINGET, GET
            b'h' => {
                fetched.insert(uint(take(&mut pos, 1)?));
            }
            b'j' => {
                fetched.insert(uint(take(&mut pos, 4)?));
            }
            b'g' => {
                fetched.insert(decimal(line(&mut pos)?)?);
            }
            _ => return None,
        }
    }
}

fn decimal(line: &[u8]) -> Option<u64> {
    std::str::from_utf8(line).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_fetched_entries_of_each_put_kind() {
        // MEMOIZE x2 (0, 1), BINPUT 5, LONG_BINPUT 6, PUT 7; fetches of 1, 5 (twice) and 7.
        let mut p = vec![0x80, 4, b'N', 0x94, b'N', 0x94, b'N', b'q', 5];
        p.extend_from_slice(&[b'N', b'r', 6, 0, 0, 0, b'N']);
        p.extend_from_slice(b"p7\n");
        p.extend_from_slice(&[b'h', 1, b'j', 5, 0, 0, 0, b'h', 5]);
        p.extend_from_slice(b"g7\n.");
        let fetched = fetched_memo(&p).unwrap();
        let mut got: Vec<u64> = fetched.into_iter().collect();
        got.sort();
        assert_eq!(got, vec![1, 5, 7]);
    }

    #[test]
    fn lengths_are_skipped_and_unknown_opcodes_give_up() {
        // A string whose bytes look like a BINGET is skipped whole.
        let p = [0x80, 4, 0x8c, 2, b'h', 9, b'.'];
        assert_eq!(fetched_memo(&p).unwrap().len(), 0);
        assert!(fetched_memo(&[0x80, 4, b'o', b'.']).is_none());
        assert!(
            fetched_memo(&[0x80, 4, 0x8c, 9, b'a']).is_none(),
            "truncated"
        );
    }
}
