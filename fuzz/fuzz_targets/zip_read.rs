//! The ZIP reader on arbitrary bytes: accepted entries lie inside the slice and do not overlap.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(entries) = ckpt::zip::read_entries(data) else {
        return;
    };
    let mut spans: Vec<(u64, u64)> = Vec::new();
    for e in &entries {
        let end = e
            .data_offset
            .checked_add(e.stored_len())
            .expect("entry end overflows");
        assert!(end <= data.len() as u64, "entry past the end: {e:?}");
        spans.push((e.data_offset, end));
    }
    spans.sort_unstable();
    for w in spans.windows(2) {
        assert!(
            w[0].1 <= w[1].0 || w[0].0 == w[0].1 || w[1].0 == w[1].1,
            "entries overlap: {spans:?}"
        );
    }
});
