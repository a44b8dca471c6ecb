//! The documentation holds together: every markdown link in README.md, docs/, ARCHITECTURE.md,
//! CONTRIBUTING.md and BENCHMARKS.md resolves (a relative target that exists, and an anchor that
//! is a heading of the markdown file it points into, by GitHub's slug rules), every page under
//! docs/ is linked from somewhere, and README.md stays a five-minute read: at most 300 lines,
//! its first code block the quick start, its only other command the one that runs every test;
//! and the recipes `tests/interop/test_parts.py` runs are where it reads them.

use std::collections::{BTreeSet, HashMap};
use std::path::{Component, Path, PathBuf};

const README_MAX_LINES: usize = 300;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The markdown files whose links must resolve.
fn documents() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = [
        "README.md",
        "ARCHITECTURE.md",
        "CONTRIBUTING.md",
        "BENCHMARKS.md",
    ]
    .iter()
    .map(|f| root().join(f))
    .collect();
    files.extend(markdown_under(&root().join("docs")));
    files
}

/// Every `.md` file under `dir`, in a stable order.
fn markdown_under(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("cannot list `{}`: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            found.extend(markdown_under(&path));
        } else if path.extension().is_some_and(|e| e == "md") {
            found.push(path);
        }
    }
    found
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read `{}`: {e}", path.display()))
}

/// `path` relative to the repository, for messages.
fn shown(path: &Path) -> String {
    path.strip_prefix(root())
        .unwrap_or(path)
        .display()
        .to_string()
}

/// A fenced code block's opening or closing line: its fence character and length.
fn fence(line: &str) -> Option<(char, usize)> {
    let trimmed = line.trim_start_matches(' ');
    if line.len() - trimmed.len() > 3 {
        return None;
    }
    let c = trimmed.chars().next()?;
    if c != '`' && c != '~' {
        return None;
    }
    let n = trimmed.chars().take_while(|&x| x == c).count();
    (n >= 3).then_some((c, n))
}

/// A document split into its prose (fenced code blocks blanked, so line numbers stay) and the
/// contents of its fenced code blocks, in order.
struct Parsed {
    prose: String,
    code_blocks: Vec<String>,
}

fn parse(text: &str) -> Parsed {
    let mut prose = String::with_capacity(text.len());
    let mut code_blocks = Vec::new();
    let mut open: Option<((char, usize), String)> = None;
    for line in text.lines() {
        match open.take() {
            None => match fence(line) {
                Some(f) => open = Some((f, String::new())),
                None => prose.push_str(line),
            },
            Some(((c, n), mut block)) => match fence(line) {
                // A closing fence is the opening's character, at least as long, and nothing else.
                Some((c2, n2)) if c2 == c && n2 >= n && line.trim().chars().all(|x| x == c) => {
                    code_blocks.push(block);
                }
                _ => {
                    block.push_str(line);
                    block.push('\n');
                    open = Some(((c, n), block));
                }
            },
        }
        prose.push('\n');
    }
    if let Some((_, block)) = open {
        code_blocks.push(block);
    }
    Parsed { prose, code_blocks }
}

/// `text` with the contents of its inline code spans blanked (newlines kept): a link inside
/// backticks is code, not a link. A run of backticks opens a span that the next run of the same
/// length closes, within one paragraph; without one, the backticks are literal.
fn without_code_spans(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = chars.clone();
    let run_at = |i: usize| chars[i..].iter().take_while(|&&c| c == '`').count();
    let mut i = 0;
    while i < chars.len() {
        if chars[i] != '`' {
            i += 1;
            continue;
        }
        let n = run_at(i);
        let mut j = i + n;
        let mut close = None;
        while j < chars.len() {
            if chars[j] == '\n' && chars.get(j + 1) == Some(&'\n') {
                break;
            }
            if chars[j] == '`' {
                let m = run_at(j);
                if m == n {
                    close = Some(j);
                    break;
                }
                j += m;
            } else {
                j += 1;
            }
        }
        match close {
            Some(j) => {
                for c in &mut out[i + n..j] {
                    if *c != '\n' {
                        *c = ' ';
                    }
                }
                i = j + n;
            }
            None => i += n,
        }
    }
    out.into_iter().collect()
}

/// A link found in prose: its 1-based line and its destination.
#[derive(Debug, PartialEq, Eq)]
struct Link {
    line: usize,
    target: String,
}

/// Every inline link `[text](target)` (and image `![alt](target)`) of `prose`, whose code spans
/// are already blanked. Link text may hold brackets and run over lines, not over a blank line.
fn links(prose: &str) -> Vec<Link> {
    let chars: Vec<char> = prose.chars().collect();
    let line_of = |i: usize| chars[..i].iter().filter(|&&c| c == '\n').count() + 1;
    let mut found = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        if chars[i] != '[' || (i > 0 && chars[i - 1] == '\\') {
            i += 1;
            continue;
        }
        // The matching `]`.
        let mut depth = 0;
        let mut close = None;
        let mut j = i;
        while j < chars.len() {
            match chars[j] {
                '\\' => j += 1,
                '[' => depth += 1,
                ']' => {
                    depth -= 1;
                    if depth == 0 {
                        close = Some(j);
                        break;
                    }
                }
                '\n' if chars.get(j + 1) == Some(&'\n') => break,
                _ => {}
            }
            j += 1;
        }
        let Some(close) = close else {
            i += 1;
            continue;
        };
        if chars.get(close + 1) != Some(&'(') {
            i += 1;
            continue;
        }
        // The destination: `<...>`, or up to whitespace or the `)` that balances the `(`.
        let mut k = close + 2;
        while k < chars.len() && (chars[k] == ' ' || chars[k] == '\n') {
            k += 1;
        }
        let mut target = String::new();
        if chars.get(k) == Some(&'<') {
            k += 1;
            while k < chars.len() && chars[k] != '>' && chars[k] != '\n' {
                target.push(chars[k]);
                k += 1;
            }
        } else {
            let mut parens = 0;
            while k < chars.len() && !chars[k].is_whitespace() {
                match chars[k] {
                    '(' => parens += 1,
                    ')' if parens == 0 => break,
                    ')' => parens -= 1,
                    _ => {}
                }
                target.push(chars[k]);
                k += 1;
            }
        }
        found.push(Link {
            line: line_of(i),
            target,
        });
        i = close + 1;
    }
    found
}

/// GitHub's anchor for a heading: its text as rendered (a link's text, without code and
/// emphasis markers), lowercased, spaces to `-`, and every character dropped that is neither
/// alphanumeric nor `-` nor `_`.
fn slug(heading: &str) -> String {
    let mut text = String::new();
    let mut rest = heading;
    // `[text](target)` renders as `text`.
    while let Some(open) = rest.find('[') {
        let Some(mid) = rest[open..].find("](") else {
            break;
        };
        let Some(end) = rest[open + mid..].find(')') else {
            break;
        };
        text.push_str(&rest[..open]);
        text.push_str(&rest[open + 1..open + mid]);
        rest = &rest[open + mid + end + 1..];
    }
    text.push_str(rest);
    text.to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The text of an ATX heading (`## Title`), if `line` is one.
fn heading(line: &str) -> Option<&str> {
    let trimmed = line.trim_start_matches(' ');
    if line.len() - trimmed.len() > 3 {
        return None;
    }
    let level = trimmed.chars().take_while(|&c| c == '#').count();
    if !(1..=6).contains(&level) {
        return None;
    }
    let text = &trimmed[level..];
    if !(text.is_empty() || text.starts_with(' ') || text.starts_with('\t')) {
        return None;
    }
    let text = text.trim();
    // An optional closing sequence of `#`s, after a space.
    let unclosed = text.trim_end_matches('#');
    Some(if unclosed.is_empty() || unclosed.ends_with(' ') {
        unclosed.trim_end()
    } else {
        text
    })
}

/// Every anchor a markdown file has: its headings' slugs, a repeated slug numbered `-1`, `-2`, ...
/// as GitHub numbers it.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut out = BTreeSet::new();
    for line in parse(text).prose.lines() {
        let Some(h) = heading(line) else { continue };
        let base = slug(h);
        let n = seen.entry(base.clone()).or_insert(0);
        out.insert(match *n {
            0 => base.clone(),
            k => format!("{base}-{k}"),
        });
        *n += 1;
    }
    out
}

/// `%20` and the like, decoded; anything malformed is left as it is.
fn percent_decoded(s: &str) -> String {
    let bytes = s.as_bytes();
    let hex = |b: u8| (b as char).to_digit(16);
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if let (b'%', Some(&hi), Some(&lo)) = (bytes[i], bytes.get(i + 1), bytes.get(i + 2)) {
            if let (Some(hi), Some(lo)) = (hex(hi), hex(lo)) {
                out.push((hi * 16 + lo) as u8);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `path` with `.` and `..` resolved without touching the filesystem.
fn normalized(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

/// Why `target`, linked from `doc`, does not resolve; `None` when it does.
fn broken(
    doc: &Path,
    target: &str,
    anchor_cache: &mut HashMap<PathBuf, BTreeSet<String>>,
) -> Option<String> {
    let lower = target.to_ascii_lowercase();
    if lower.starts_with("http://") || lower.starts_with("https://") || lower.starts_with("mailto:")
    {
        return None;
    }
    if target.is_empty() {
        return Some("empty link target".into());
    }
    if target.contains("://") {
        return Some("a scheme other than http(s) or mailto".into());
    }
    let (path, anchor) = match target.split_once('#') {
        Some((p, a)) => (p, Some(percent_decoded(a))),
        None => (target, None),
    };
    let file = if path.is_empty() {
        doc.to_path_buf()
    } else if let Some(from_root) = path.strip_prefix('/') {
        normalized(&root().join(percent_decoded(from_root)))
    } else {
        normalized(
            &doc.parent()
                .expect("a document's directory")
                .join(percent_decoded(path)),
        )
    };
    if !file.starts_with(root()) {
        return Some("points outside the repository".into());
    }
    if !file.exists() {
        return Some(format!("`{}` does not exist", shown(&file)));
    }
    let anchor = anchor?;
    if file.extension().is_none_or(|e| e != "md") || file.is_dir() {
        return Some(format!(
            "an anchor into `{}`, which is not a markdown file",
            shown(&file)
        ));
    }
    let known = anchor_cache
        .entry(file.clone())
        .or_insert_with(|| anchors(&read(&file)));
    if known.contains(&anchor) {
        return None;
    }
    Some(format!(
        "`{}` has no heading whose anchor is `#{anchor}`",
        shown(&file)
    ))
}

#[test]
fn every_link_of_the_documentation_resolves() {
    let mut cache = HashMap::new();
    let mut problems = Vec::new();
    let mut count = 0;
    for doc in documents() {
        let prose = without_code_spans(&parse(&read(&doc)).prose);
        for link in links(&prose) {
            count += 1;
            if let Some(why) = broken(&doc, &link.target, &mut cache) {
                problems.push(format!(
                    "{}:{}: ({}): {why}",
                    shown(&doc),
                    link.line,
                    link.target
                ));
            }
        }
    }
    assert!(count > 0, "no links found: the parser is broken");
    assert!(
        problems.is_empty(),
        "{} of {count} links do not resolve:\n{}",
        problems.len(),
        problems.join("\n")
    );
}

#[test]
fn every_page_under_docs_is_linked_from_another() {
    let mut linked = BTreeSet::new();
    for doc in documents() {
        let prose = without_code_spans(&parse(&read(&doc)).prose);
        for link in links(&prose) {
            let path = link.target.split('#').next().unwrap_or_default();
            if path.is_empty() || path.contains("://") || path.starts_with("mailto:") {
                continue;
            }
            let file = normalized(
                &doc.parent()
                    .expect("a directory")
                    .join(percent_decoded(path)),
            );
            if file != doc {
                linked.insert(file);
            }
        }
    }
    let orphans: Vec<String> = markdown_under(&root().join("docs"))
        .into_iter()
        .filter(|page| !linked.contains(page))
        .map(|page| shown(&page))
        .collect();
    assert!(
        orphans.is_empty(),
        "pages no document links to: {}",
        orphans.join(", ")
    );
}

#[test]
fn the_readme_is_short_and_starts_with_the_quick_start() {
    let text = read(&root().join("README.md"));
    let lines = text.lines().count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines, more than {README_MAX_LINES}: move the detail to docs/"
    );
    let blocks = parse(&text).code_blocks;
    let first = blocks.first().expect("README.md has no code block");
    assert!(
        first.contains("ckpt consolidate"),
        "README.md's first code block is not the quick start:\n{first}"
    );
    for block in &blocks[1..] {
        assert_eq!(
            block.trim(),
            "scripts/test",
            "README.md's only command after the quick start is the one that runs every test"
        );
    }
}

#[test]
fn the_recipes_of_partitioned_runs_are_where_their_test_reads_them() {
    // tests/interop/test_parts.py runs each as written: the fenced block right after its marker.
    let text = read(&root().join("docs/parts.md"));
    for name in ["xargs", "slurm", "kubernetes"] {
        let marker = format!("<!-- recipe: {name} -->\n");
        let at = text
            .find(&marker)
            .unwrap_or_else(|| panic!("docs/parts.md has no `{}`", marker.trim()));
        let next = text[at + marker.len()..].lines().next().unwrap_or_default();
        assert!(
            fence(next).is_some(),
            "the recipe `{name}` in docs/parts.md is not a fenced block right after its marker"
        );
    }
}

#[test]
fn slugs_follow_github() {
    assert_eq!(slug("Quick start"), "quick-start");
    assert_eq!(
        slug("FSDP1 `LOCAL_STATE_DICT`: `--shapes-from REF`"),
        "fsdp1-local_state_dict---shapes-from-ref"
    );
    assert_eq!(
        slug("DeepSpeed ZeRO against `zero_to_fp32.py`"),
        "deepspeed-zero-against-zero_to_fp32py"
    );
    assert_eq!(
        slug("See [the docs](docs/README.md) now"),
        "see-the-docs-now"
    );
    assert_eq!(slug("**Bold** and *more*"), "bold-and-more");
    let text = "# A\n## A\n```\n# not a heading\n```\n### A ##\n#nope\n";
    let found: Vec<String> = anchors(text).into_iter().collect();
    assert_eq!(found, ["a", "a-1", "a-2"]);
}

#[test]
fn links_in_code_are_not_links() {
    let text = "[a](x.md) `[b](y.md)` ``[c](`z`)``\n```\n[d](w.md)\n```\n[e\nf](v.md#top) ![g](i.png)\n[h] (not) [i][ref]\n";
    let prose = without_code_spans(&parse(text).prose);
    let found: Vec<(usize, String)> = links(&prose)
        .into_iter()
        .map(|l| (l.line, l.target))
        .collect();
    let want = [(1, "x.md"), (5, "v.md#top"), (6, "i.png")].map(|(l, t)| (l, t.to_string()));
    assert_eq!(found, want);
}
