//! Unit tests of ZIP reading and writing.

use super::*;
use proptest::prelude::*;

const VIEWS: &[u8] = include_bytes!("../formats/testdata/views.pt");
const DTYPES: &[u8] = include_bytes!("../formats/testdata/dtypes.pt");
const BARE: &[u8] = include_bytes!("../formats/testdata/bare.pt");
const NESTED: &[u8] = include_bytes!("../formats/testdata/nested.pt");
/// A real > 4 GiB torch.save archive without the data of its big record (see `make.py`).
const ZIP64_FRAMING: &[u8] = include_bytes!("../formats/testdata/zip64_framing.bin");

fn literal(name: &str, content: &[u8]) -> ZipRecord {
    ZipRecord {
        name: name.into(),
        len: content.len() as u64,
        content: Some(content.to_vec()),
    }
}

fn data<'a>(bytes: &'a [u8], e: &ZipEntry) -> &'a [u8] {
    &bytes[e.data_offset as usize..(e.data_offset + e.len) as usize]
}

#[test]
fn reads_real_archive() {
    // Offsets as Python's zipfile reports them for this file.
    let entries = read_entries(BARE).unwrap();
    let names: Vec<_> = entries.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "archive/data.pkl",
            "archive/.format_version",
            "archive/.storage_alignment",
            "archive/byteorder",
            "archive/data/0",
            "archive/version",
            "archive/.data/serialization_id",
        ]
    );
    for e in &entries {
        assert_eq!(e.data_offset % ALIGNMENT, 0, "{} is aligned", e.name);
    }
    assert_eq!(data(BARE, &entries[1]), b"1");
    assert_eq!(data(BARE, &entries[2]), b"64");
    assert_eq!(data(BARE, &entries[3]), b"little");
    assert_eq!(data(BARE, &entries[5]), b"3\n");
    // arange(6) in bf16: 0, 1, 2, 3, 4, 5.
    assert_eq!(entries[4].len, 12);
    assert_eq!(&data(BARE, &entries[4])[..4], &[0x00, 0x00, 0x80, 0x3f]);
    assert_eq!(entries[6].len, 40);
}

#[test]
fn layout_reproduces_torch_byte_for_byte() {
    for real in [VIEWS, DTYPES, BARE, NESTED] {
        let records: Vec<_> = read_entries(real)
            .unwrap()
            .iter()
            .map(|e| literal(&e.name, data(real, e)))
            .collect();
        assert_eq!(build(&records, &[]).unwrap(), real);
    }
}

#[test]
fn caller_filled_records_round_trip() {
    let big: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
    let records = vec![
        literal("a/data.pkl", b"pickle"),
        ZipRecord {
            name: "a/data/0".into(),
            len: big.len() as u64,
            content: None,
        },
        ZipRecord {
            name: "a/data/1".into(),
            len: 0,
            content: None,
        },
        literal("a/version", b"3\n"),
    ];
    let plan = layout(&records);
    assert!(plan.crc_slots[0].is_empty() && plan.crc_slots[3].is_empty());
    assert_eq!(plan.crc_slots[1].len(), 2);
    // Literal runs never overlap the data the caller writes.
    for (at, run) in &plan.literals {
        let end = at + run.len() as u64;
        assert!(end <= plan.data_offsets[1] || *at >= plan.data_offsets[1] + big.len() as u64);
    }
    let bytes = build(&records, &[&big, &[]]).unwrap();
    assert_eq!(bytes.len() as u64, plan.len);
    let entries = read_entries(&bytes).unwrap();
    assert_eq!(entries.len(), 4);
    assert_eq!(data(&bytes, &entries[1]), &big[..]);
    assert_eq!(entries[1].data_offset, plan.data_offsets[1]);
    assert_eq!(entries[2].len, 0);
    // The CRC the central directory holds is the one patched in.
    let central = plan.crc_slots[1][1] as usize;
    assert_eq!(
        &bytes[central..central + 4],
        &crc32fast::hash(&big).to_le_bytes()
    );
    let descriptor = plan.crc_slots[1][0] as usize;
    assert_eq!(
        &bytes[descriptor - 4..descriptor],
        &DESCRIPTOR_SIG.to_le_bytes()
    );
    assert!(build(&records, &[&big]).is_err());
    assert!(build(&records, &[&big, &[1]]).is_err());
}

#[test]
fn zip64_layout_matches_torch() {
    // The records of the real archive (`make.py --zip64`), its 4 GiB record left for the
    // caller; sizes, CRC and offsets as Python's zipfile reports them.
    let (big_index, big_len, big_crc) = (5, (1u64 << 32) + 100, 2_838_121_701u32);
    let head_len = 1024u64;
    // Framing positions past the big record sit `big_len` earlier in the fixture.
    let squeeze = |at: u64| {
        if at < head_len {
            at as usize
        } else {
            (at - big_len) as usize
        }
    };
    let pickle = &ZIP64_FRAMING[64..64 + 316];
    let id_at = squeeze(4_294_968_666 + 30 + 26 + 46);
    let serialization_id = &ZIP64_FRAMING[id_at..id_at + 40];
    let one = [0, 0, 0x80, 0x3f];
    let records = vec![
        literal("big/data.pkl", pickle),
        literal("big/.format_version", b"1"),
        literal("big/.storage_alignment", b"64"),
        literal("big/byteorder", b"little"),
        literal("big/data/0", &one.repeat(3)),
        ZipRecord {
            name: "big/data/1".into(),
            len: big_len,
            content: None,
        },
        literal("big/data/2", &one.repeat(2)),
        literal("big/version", b"3\n"),
        literal("big/.data/serialization_id", serialization_id),
    ];
    let plan = layout(&records);
    assert_eq!(plan.len, ZIP64_FRAMING.len() as u64 + big_len);
    assert_eq!(plan.data_offsets[big_index], head_len);
    let mut expected = vec![0u8; ZIP64_FRAMING.len()];
    let mut covered = vec![false; ZIP64_FRAMING.len()];
    for (at, run) in &plan.literals {
        let at = squeeze(*at);
        expected[at..at + run.len()].copy_from_slice(run);
        covered[at..at + run.len()]
            .iter_mut()
            .for_each(|c| *c = true);
    }
    for (at, crc) in plan.crc_patches(big_index, big_crc) {
        expected[squeeze(at)..squeeze(at) + 4].copy_from_slice(&crc);
    }
    assert!(
        covered.iter().all(|&c| c),
        "every framing byte is a literal"
    );
    assert_eq!(expected, ZIP64_FRAMING);
}

#[test]
fn zip64_fields_in_headers() {
    let big = 0x1_0000_0005u64;
    let records = vec![
        ZipRecord {
            name: "a/data/0".into(),
            len: big,
            content: None,
        },
        literal("a/version", b"3\n"),
    ];
    let plan = layout(&records);
    let run = |at: u64| {
        plan.literals
            .iter()
            .find(|(s, r)| *s <= at && at < s + r.len() as u64)
            .unwrap()
    };
    let local = &plan.literals[0].1;
    // Local header: sizes zero, then a zip64 field (size, compressed size 0) before the padding.
    assert_eq!(&local[18..26], &[0; 8]);
    assert_eq!(&local[30 + 8..30 + 8 + 4], &[1, 0, 16, 0]);
    assert_eq!(&local[42..50], &big.to_le_bytes());
    assert_eq!(&local[50..58], &[0; 8]);
    assert_eq!(plan.data_offsets[0] % ALIGNMENT, 0);
    // The record after it starts beyond 4 GiB: its local header carries its offset.
    let second = plan.data_offsets[0] + big + 24;
    let (start, bytes) = run(second);
    let local2 = &bytes[(second - start) as usize..];
    assert_eq!(&local2[..4], &LOCAL_SIG.to_le_bytes());
    assert_eq!(
        &local2[30 + 9..30 + 9 + 12],
        &[&[1, 0, 8, 0][..], &second.to_le_bytes()].concat()[..]
    );
    // Descriptor of the big record: 8-byte sizes.
    let (start, bytes) = run(plan.data_offsets[0] + big);
    let descriptor = &bytes[(plan.data_offsets[0] + big - start) as usize..][..24];
    assert_eq!(
        &descriptor[8..],
        &[big.to_le_bytes(), big.to_le_bytes()].concat()[..]
    );
    // Central headers saturate what moved to zip64 fields.
    let cd = plan.crc_slots[0][1] - 16;
    let (start, bytes) = run(cd);
    let central = &bytes[(cd - start) as usize..];
    assert_eq!(&central[20..28], &[0xff; 8]);
    assert_eq!(&central[42..46], &[0, 0, 0, 0]);
    let central2 = &central[46 + 8 + 20..];
    assert_eq!(&central2[20..28], &[2, 0, 0, 0, 2, 0, 0, 0]);
    assert_eq!(&central2[42..46], &[0xff; 4]);
    // The classic end record saturates the directory offset.
    let tail = &plan.literals.last().unwrap().1;
    assert_eq!(&tail[tail.len() - 6..tail.len() - 2], &[0xff; 4]);
}

#[test]
fn rejects_what_torch_never_writes() {
    let bytes = build(&[literal("a/data.pkl", b"x"), literal("a/b", b"yy")], &[]).unwrap();
    let err = |b: &[u8]| read_entries(b).unwrap_err().to_string();
    let cd = read_entries(&bytes).unwrap()[1].data_offset as usize + 2 + 16;

    let mut compressed = bytes.clone();
    compressed[cd + 10] = 12; // bzip2 in the first central header
    assert!(
        err(&compressed).contains("`a/data.pkl` is compressed with method 12"),
        "{}",
        err(&compressed)
    );

    // Deflate in the central header only: the local header says stored.
    let mut deflate = bytes.clone();
    deflate[cd + 10] = 8;
    assert!(
        err(&deflate).contains("method 0 disagrees"),
        "{}",
        err(&deflate)
    );

    let mut nul = bytes.clone();
    nul[cd + 46 + 1] = 0;
    assert!(err(&nul).contains("NUL"));

    let mut size = bytes.clone();
    size[cd + 20] = 2; // central sizes say 2 while the local header is at 64 - 2
    size[cd + 24] = 2;
    assert!(
        err(&size).contains("overlap") || err(&size).contains("disagree"),
        "{}",
        err(&size)
    );

    let mut local = bytes.clone();
    local[22] = 5; // local uncompressed size neither 0 nor the central one
    assert!(
        err(&local).contains("disagrees with central directory size 1"),
        "{}",
        err(&local)
    );

    let mut dup = build(&[literal("a/x", b"1"), literal("a/x", b"2")], &[]).unwrap();
    assert!(err(&dup).contains("duplicate zip entry `a/x`"));
    dup.push(0);
    assert!(err(&dup).contains("no end-of-central-directory record"));

    assert!(err(&bytes[..bytes.len() - 1]).contains("not a zip archive"));
    assert!(err(b"").contains("too short"));
    // A stray offset past the slice is an error, not a panic.
    let mut far = bytes.clone();
    far[cd + 42..cd + 46].copy_from_slice(&0xFFFF_FFF0u32.to_le_bytes());
    assert!(err(&far).contains("points past the end"), "{}", err(&far));
}

#[test]
fn masked_local_headers_are_refused() {
    let bytes = build(&[literal("a/data.pkl", b"x"), literal("a/b", b"yy")], &[]).unwrap();
    let cd = read_entries(&bytes).unwrap()[1].data_offset as usize + 2 + 16;
    let mut masked = bytes.clone();
    masked[cd + 9] |= 0x20; // flag bit 13 of the first central header
    let e = read_entries(&masked).unwrap_err().to_string();
    assert!(
        e.contains("`a/data.pkl` has masked local headers (flag bit 13)"),
        "{e}"
    );
    // Bits 5 and 6 are kept for the reader of the record to judge.
    let mut patch = bytes.clone();
    patch[cd + 8] |= 0x60;
    assert_eq!(read_entries(&patch).unwrap()[0].flags, 0x0868);
}

#[test]
fn errors_carry_offsets() {
    let bytes = build(&[literal("a/data.pkl", b"x")], &[]).unwrap();
    let mut bad = bytes.clone();
    bad[0] = b'Q';
    let e = read_entries(&bad).unwrap_err();
    assert_eq!(e.offset, Some(0));
    assert_eq!(
        e.message,
        "zip local header of `a/data.pkl` not found where the central directory points"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn mutations_never_panic(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let mut bytes = NESTED.to_vec();
        for (at, byte) in edits {
            let at = at.index(bytes.len());
            bytes[at] = byte;
        }
        if truncate {
            bytes.truncate(cut.index(bytes.len()));
        }
        if let Ok(entries) = read_entries(&bytes) {
            for e in entries {
                prop_assert!(e.data_offset + e.len <= bytes.len() as u64);
            }
        }
    }

    #[test]
    fn layouts_read_back(
        lens in prop::collection::vec(0u64..300, 1..12),
        literal_mask in any::<u16>(),
    ) {
        let records: Vec<_> = lens.iter().enumerate().map(|(i, &len)| {
            let name = format!("p/data/{i}");
            if literal_mask >> (i % 16) & 1 == 1 {
                ZipRecord { name, len, content: Some(vec![i as u8; len as usize]) }
            } else {
                ZipRecord { name, len, content: None }
            }
        }).collect();
        let fills: Vec<Vec<u8>> = records.iter().enumerate()
            .filter(|(_, r)| r.content.is_none())
            .map(|(i, r)| vec![!(i as u8); r.len as usize])
            .collect();
        let fill_refs: Vec<&[u8]> = fills.iter().map(|f| f.as_slice()).collect();
        let bytes = build(&records, &fill_refs).unwrap();
        let entries = read_entries(&bytes).unwrap();
        prop_assert_eq!(entries.len(), records.len());
        let plan = layout(&records);
        for (i, e) in entries.iter().enumerate() {
            prop_assert_eq!(e.data_offset, plan.data_offsets[i]);
            prop_assert_eq!(e.data_offset % ALIGNMENT, 0);
            prop_assert_eq!(e.len, lens[i]);
        }
    }
}
