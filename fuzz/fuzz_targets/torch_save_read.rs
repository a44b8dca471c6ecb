//! The torch.save archive reader on arbitrary bytes: every tensor it accepts must lie inside its
//! storage record, and every record inside the archive.
#![no_main]

use ckpt::formats::torch_save::{self, Leaf};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(archive) = torch_save::read(data) else {
        return;
    };
    for e in &archive.entries {
        assert!(e
            .data_offset
            .checked_add(e.stored_len())
            .is_some_and(|end| end <= data.len() as u64));
    }
    for (_, leaf) in &archive.leaves {
        if let Leaf::Tensor(t) = leaf {
            let Some(record) = archive.storage(&t.storage_key) else {
                continue;
            };
            let elem = t.dtype.size() as u64;
            // Offset of one past the last element the view touches, in elements.
            let last = t
                .shape
                .iter()
                .zip(&t.strides)
                .try_fold(0u64, |acc, (&n, &s)| {
                    if n == 0 {
                        None
                    } else {
                        acc.checked_add((n - 1).checked_mul(s)?)
                    }
                });
            if let Some(last) = last {
                let end = t
                    .storage_offset
                    .checked_add(last)
                    .and_then(|e| e.checked_add(1))
                    .and_then(|e| e.checked_mul(elem));
                assert!(
                    end.is_some_and(|end| end <= record.len),
                    "view past its storage record: {t:?} in {record:?}"
                );
            }
        }
    }
});
