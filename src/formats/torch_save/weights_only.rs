//! What torch's weights-only unpickler allows, as rules on the pickle ckpt has read as data: the
//! globals (`TorchGlobals`), the opcodes it refuses, the calls it lets through with their argument
//! checks (and the Python codec tables `_codecs.encode` needs), and `BUILD`s it can apply.

use super::*;
use crate::pickle::opcodes as op;

/// The first opcode of `pkl` outside the set torch's weights-only unpickler runs
/// (`torch/_weights_only_unpickler.py`), with its offset: `FRAME`, `MEMOIZE`, `SHORT_BINUNICODE`,
/// `BINBYTES` and the rest of protocols 0, 1, 3-5 make torch.load refuse the file, though ckpt's
/// pickle reader, shared with DCP's `.metadata`, reads them. Run on a pickle that reader accepted,
/// so a truncated one (`None` here) does not occur.
pub(super) fn opcode_torch_refuses(pkl: &[u8]) -> Option<(u8, usize)> {
    let mut at = 0;
    loop {
        let opcode = *pkl.get(at)?;
        match opcode {
            op::STOP => return None,
            op::PROTO
            | op::MARK
            | op::NONE
            | op::NEWTRUE
            | op::NEWFALSE
            | op::BININT
            | op::BININT1
            | op::BININT2
            | op::LONG1
            | op::BINFLOAT
            | op::SHORT_BINSTRING
            | op::BINUNICODE
            | op::EMPTY_TUPLE
            | op::TUPLE
            | op::TUPLE1
            | op::TUPLE2
            | op::TUPLE3
            | op::EMPTY_LIST
            | op::APPEND
            | op::APPENDS
            | op::EMPTY_DICT
            | op::SETITEM
            | op::SETITEMS
            | op::EMPTY_SET
            | op::BINPUT
            | op::LONG_BINPUT
            | op::BINGET
            | op::LONG_BINGET
            | op::GLOBAL
            | op::REDUCE
            | op::NEWOBJ
            | op::BUILD
            | op::BINPERSID => {}
            _ => return Some((opcode, at)),
        }
        at += 1 + op::argument(pkl, at)?.len();
    }
}

/// Refuse the calls torch's weights-only unpickler cannot make: it calls (`REDUCE`) or
/// instantiates (`NEWOBJ`) only an allowed global, so never a tuple or an `OrderedDict` instance,
/// and `torch.Size` takes at most one iterable of ints.
pub(super) fn check_calls(value: &Value) -> Result<()> {
    match value {
        Value::Tuple(items) | Value::List(items) | Value::Set(items) => {
            items.iter().try_for_each(check_calls)
        }
        Value::Dict(items) => items.iter().try_for_each(|(k, v)| {
            check_key(k)?;
            check_calls(k).and_then(|()| check_calls(v))
        }),
        Value::PersistentId(id) => check_calls(id),
        Value::Object(object) => {
            let Value::Global(global) = &object.callable else {
                if is_process_group_state(&object.callable) {
                    object.args.iter().try_for_each(check_calls)?;
                    return object.state.as_ref().map_or(Ok(()), check_calls);
                }
                let what = if object.new_obj {
                    "`NEWOBJ`"
                } else {
                    "`REDUCE`"
                };
                return Err(bad(format!(
                    "{what} applies to {}, not a class or function, which torch.load(weights_only=True) refuses",
                    kind_name(&object.callable)
                )));
            };
            let (module, name) = (global.module.as_str(), global.name.as_str());
            match callable_kind(module, name) {
                Callable::Class => {}
                Callable::Function if !object.new_obj => {}
                kind => {
                    let (op, what) = match (object.new_obj, kind) {
                        (true, Callable::Function) => ("`NEWOBJ`", "a function, not a class"),
                        (true, _) => ("`NEWOBJ`", "not a class"),
                        _ => ("`REDUCE`", "not callable"),
                    };
                    return Err(bad(format!(
                        "{op} applies to `{module}.{name}`, {what}, which torch.load(weights_only=True) refuses"
                    )));
                }
            }
            if let Some(state) = &object.state {
                check_build(module, name, state)?;
            }
            match (module, name) {
                ("collections", "Counter") => {
                    return Err(bad(
                        "a `collections.Counter` made other than from one dict, which ckpt does not read",
                    ))
                }
                ("torch", "Size") => check_size_args(&object.args)?,
                ("_codecs", "encode") => check_encode_args(&object.args)?,
                ("builtins", "set") => check_set_args(&object.args)?,
                ("builtins", "bytearray") => check_bytearray_args(&object.args)?,
                ("builtins", "complex") => check_complex_args(&object.args)?,
                ("torch", "device") => check_device_args(&object.args)?,
                ("builtins", "getattr") => check_getattr(&object.args)?,
                _ => {}
            }
            object.args.iter().try_for_each(check_calls)?;
            object.dict_items.iter().try_for_each(|(k, v)| {
                check_key(k)?;
                check_calls(k).and_then(|()| check_calls(v))
            })?;
            object.list_items.iter().try_for_each(check_calls)?;
            object.state.as_ref().map_or(Ok(()), check_calls)
        }
        _ => Ok(()),
    }
}

/// What an allowed global is to torch's weights-only unpickler: a class it may instantiate
/// (`NEWOBJ`) or call (`REDUCE`), a function it may only call, or neither (a dtype, a legacy
/// storage class: `'torch.dtype' object is not callable`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Callable {
    Class,
    Function,
    Neither,
}

pub(super) fn callable_kind(module: &str, name: &str) -> Callable {
    match (module, name) {
        ("torch._utils" | "torch._tensor" | "_codecs" | "torch.serialization", _)
        | ("builtins", "getattr") => Callable::Function,
        ("torch", name)
            if DType::from_storage_class(name).is_some()
                || OTHER_STORAGE_CLASSES.contains(&name)
                || DType::from_torch_name(name).is_some()
                || OTHER_DTYPES.contains(&name) =>
        {
            Callable::Neither
        }
        // The classes of TorchGlobals and of the per-rank allow-list.
        _ => Callable::Class,
    }
}

/// `BUILD` as torch's weights-only unpickler applies it: an `OrderedDict` or an untyped storage
/// takes a dict into its `__dict__`; a set, bytearray, complex, `torch.Size` or device has no
/// `__dict__`, so only an empty state passes; bytes (`_codecs.encode`) cannot be built at all.
/// A tensor's state would re-point its storage (`Tensor.set_`), which ckpt does not follow.
pub(super) fn check_build(module: &str, name: &str, state: &Value) -> Result<()> {
    fn empty(v: &Value) -> bool {
        match v {
            Value::None => true,
            Value::Bool(b) => !b,
            Value::Int(i) => *i == 0,
            Value::Str(s) => s.is_empty(),
            Value::Bytes(b) => b.is_empty(),
            Value::Tuple(items) | Value::List(items) | Value::Set(items) => items.is_empty(),
            Value::Dict(items) => items.is_empty(),
            _ => false,
        }
    }
    let ok = match (module, name) {
        ("collections", "OrderedDict") | ("torch.storage", "UntypedStorage") => {
            matches!(state, Value::Dict(_) | Value::None)
                || matches!(state, Value::Tuple(t) if t.is_empty())
        }
        ("builtins", _) | ("torch", "Size" | "device") => {
            empty(state) || matches!(state, Value::Tuple(t) if t.len() == 2 && t.iter().all(empty))
        }
        // What a function returns: a tensor (whose storage ckpt would not follow), bytes.
        ("torch._utils" | "torch._tensor" | "_codecs" | "torch.serialization", _) => false,
        // Dataclasses of other allow-lists (DTensorSpec, ...) take their `__dict__`.
        _ => true,
    };
    if ok {
        return Ok(());
    }
    Err(bad(format!(
        "`BUILD` gives {} to a `{module}.{name}` object, which torch.load(weights_only=True) cannot apply",
        kind_name(state)
    )))
}

/// `builtins.bytearray(*args)`: none, a count, bytes, a list of byte values, or a str with an
/// encoding. ckpt refuses what it cannot tell Python accepts.
pub(super) fn check_bytearray_args(args: &[Value]) -> Result<()> {
    let ok = match args {
        [] => true,
        [Value::Int(n)] => *n >= 0,
        [Value::Bool(_) | Value::Bytes(_)] => true,
        [v] if made_bytes(v) => true,
        [Value::List(items) | Value::Tuple(items)] => items
            .iter()
            .all(|v| matches!(v, Value::Int(0..=255) | Value::Bool(_))),
        [Value::Str(_), Value::Str(_)] | [Value::Str(_), Value::Str(_), Value::Str(_)] => {
            check_encode_args(args).is_ok()
        }
        _ => false,
    };
    if ok {
        return Ok(());
    }
    Err(bad(format!(
        "`builtins.bytearray` called with {} argument(s) ckpt cannot tell Python accepts",
        args.len()
    )))
}

/// `builtins.complex(real, imag)` of numbers, as torch.save writes complex values.
pub(super) fn check_complex_args(args: &[Value]) -> Result<()> {
    let number = |v: &Value| matches!(v, Value::Int(_) | Value::Bool(_) | Value::Float(_));
    if args.len() <= 2 && args.iter().all(number) {
        return Ok(());
    }
    Err(bad(
        "`builtins.complex` called with arguments other than one or two numbers",
    ))
}

/// `torch.device(type)`, `torch.device("type:index")`, `torch.device(type, index)` or
/// `torch.device(index)`, as torch parses them.
pub(super) fn check_device_args(args: &[Value]) -> Result<()> {
    const TYPES: &[&str] = &[
        "cpu",
        "cuda",
        "ipu",
        "xpu",
        "mkldnn",
        "opengl",
        "opencl",
        "ideep",
        "hip",
        "ve",
        "fpga",
        "maia",
        "xla",
        "lazy",
        "vulkan",
        "mps",
        "meta",
        "hpu",
        "mtia",
        "privateuseone",
    ];
    let index = |s: &str| {
        !s.is_empty()
            && s.bytes().all(|b| b.is_ascii_digit())
            && (s == "0" || !s.starts_with('0'))
            && s.parse::<i8>().is_ok()
    };
    let device = |s: &str| match s.split_once(':') {
        Some((t, i)) => TYPES.contains(&t) && index(i),
        None => TYPES.contains(&s),
    };
    let ok = match args {
        [Value::Str(s)] => device(s),
        [Value::Int(i)] => (0..=i64::from(i8::MAX)).contains(i),
        [Value::Str(s), Value::Int(i)] => {
            TYPES.contains(&s.as_str()) && (0..=i64::from(i8::MAX)).contains(i)
        }
        _ => false,
    };
    if ok {
        return Ok(());
    }
    Err(bad(
        "`torch.device` called with arguments that do not name a device torch knows",
    ))
}

/// `builtins.set(*args)`: at most one argument, an iterable whose items Python can hash.
pub(super) fn check_set_args(args: &[Value]) -> Result<()> {
    match args {
        [] | [Value::Dict(_) | Value::Str(_) | Value::SurrogateStr(_) | Value::Bytes(_)] => Ok(()),
        [Value::Tuple(items) | Value::List(items) | Value::Set(items)] => {
            items.iter().try_for_each(check_key)
        }
        [Value::Object(_) | Value::PersistentId(_)] => Ok(()),
        [other] => Err(bad(format!(
            "`builtins.set` called on {}, which is not iterable",
            kind_name(other)
        ))),
        _ => Err(bad(format!(
            "`builtins.set` called with {} arguments, but it takes at most one",
            args.len()
        ))),
    }
}

/// Refuse a dict key or set item Python cannot hash: a list, dict, set, bytearray or
/// `OrderedDict`, or a tuple holding one.
pub(super) fn check_key(key: &Value) -> Result<()> {
    fn unhashable(v: &Value) -> Option<&'static str> {
        match v {
            Value::List(_) => Some("a list"),
            Value::Dict(_) => Some("a dict"),
            Value::Set(_) => Some("a set"),
            Value::Tuple(items) => items.iter().find_map(unhashable),
            Value::Object(o) => match o.callable.as_global() {
                Some(("builtins", "set")) => Some("a set"),
                Some(("builtins", "bytearray")) => Some("a bytearray"),
                Some(("collections", "OrderedDict")) => Some("an `OrderedDict`"),
                _ => None,
            },
            _ => None,
        }
    }
    match unhashable(key) {
        Some(what) => Err(bad(format!(
            "a dict key or set item is {what}, which Python cannot hash"
        ))),
        None => Ok(()),
    }
}

/// `torch.Size(*args)`, as far as the outcome is known without running it.
pub(super) fn check_size_args(args: &[Value]) -> Result<()> {
    fn ints<'a>(mut items: impl Iterator<Item = &'a Value>) -> bool {
        // torch makes a `torch.Size` of an int past 64 bits too (it fails only when printed).
        items.all(|v| matches!(v, Value::Int(_) | Value::BigInt(_) | Value::Bool(_)))
    }
    let ok = match args {
        [] => true,
        [Value::Tuple(items) | Value::List(items) | Value::Set(items)] => ints(items.iter()),
        [Value::Dict(items)] => ints(items.iter().map(|(k, _)| k)),
        [Value::Str(s)] => s.is_empty(),
        [Value::None | Value::Int(_) | Value::Float(_) | Value::Bool(_)] => false,
        [_] => true,
        _ => false,
    };
    if ok {
        return Ok(());
    }
    Err(bad(format!(
        "`torch.Size` called with {} argument(s) that are not one iterable of ints",
        args.len()
    )))
}

/// `_codecs.encode(obj, encoding="utf-8", errors="strict")`: refused when Python would not find
/// the codec (or is given no text for it), or would fail to encode `obj` with it: see
/// [`encodes`] for how far ckpt can tell.
pub(super) fn check_encode_args(args: &[Value]) -> Result<()> {
    fn text(v: Option<&Value>) -> Option<Option<&str>> {
        match v {
            None => Some(None),
            Some(Value::Str(s)) => Some(Some(s.as_str())),
            // An encoding or handler name with a lone surrogate names nothing Python has.
            Some(Value::SurrogateStr(_)) => Some(Some("\u{fffd}")),
            Some(_) => None,
        }
    }
    let (Some(encoding), Some(errors)) = (text(args.get(1)), text(args.get(2))) else {
        return Err(bad(
            "`_codecs.encode` called with an encoding or errors that is not a str",
        ));
    };
    if args.is_empty() || args.len() > 3 {
        return Err(bad(format!(
            "`_codecs.encode` called with {} arguments",
            args.len()
        )));
    }
    let name = encoding.unwrap_or("utf-8");
    let Some(codec) = python_codec(name) else {
        return Err(bad(format!(
            "`_codecs.encode` names the unknown encoding {name:?}"
        )));
    };
    // Python's bytes-to-bytes codecs take bytes; its text codecs take str.
    let bytes_codec = BYTES_CODECS.contains(&codec);
    let fits = match args.first() {
        Some(Value::Str(s)) => !bytes_codec && encodes(codec, s.chars().map(u32::from), errors),
        Some(Value::SurrogateStr(b)) => {
            !bytes_codec && encodes(codec, surrogate_str_chars(b), errors)
        }
        Some(v) if made_bytes(v) => bytes_codec,
        _ => true,
    };
    if fits {
        return Ok(());
    }
    let what = match args.first() {
        Some(v) if made_bytes(v) => "bytes",
        Some(v) => kind_name(v),
        None => "nothing",
    };
    let errors = errors.unwrap_or("strict");
    Err(bad(format!(
        "`_codecs.encode` cannot encode {what} with {name:?} and errors {errors:?} (or ckpt cannot tell that Python can)"
    )))
}

/// Whether Python's text codec `codec` encodes the characters `chars` (code points, lone
/// surrogates included) with the error handler `errors`. Exact for the codecs pickles use
/// (latin-1, ascii, the UTF family, the escapes); for the other tables (cp1252, shift_jis, ...)
/// only ASCII is known to encode, so other text is refused unless a handler replaces what the
/// table lacks: the safe side, as ckpt must not call sound what torch.load refuses.
pub(super) fn encodes(codec: &str, chars: impl Iterator<Item = u32>, errors: Option<&str>) -> bool {
    let is_surrogate = |c: u32| (0xd800..0xe000).contains(&c);
    let utf = matches!(
        codec,
        "utf_8"
            | "utf_8_sig"
            | "utf_16"
            | "utf_16_le"
            | "utf_16_be"
            | "utf_32"
            | "utf_32_le"
            | "utf_32_be"
    );
    let has = |c: u32| match codec {
        "undefined" => false,
        "latin_1" => c < 0x100,
        "ascii" => c < 0x80,
        "utf_7" | "unicode_escape" | "raw_unicode_escape" => true,
        _ if utf => !is_surrogate(c),
        _ => c < 0x80,
    };
    // idna refuses any handler but strict, whatever the text.
    if codec == "idna" && errors.is_some_and(|e| e != "strict") {
        return false;
    }
    let mut missing = chars.filter(|&c| !has(c)).peekable();
    if missing.peek().is_none() {
        return codec != "undefined";
    }
    // The handler is looked up only when a character is missing.
    match errors.unwrap_or("strict") {
        "ignore" | "replace" | "xmlcharrefreplace" | "backslashreplace" | "namereplace" => {
            codec != "undefined"
        }
        "surrogatepass" => utf && missing.all(is_surrogate),
        // Each of U+DC80..U+DCFF back to the byte it escaped, in byte-wise codecs.
        "surrogateescape" => {
            matches!(codec, "latin_1" | "ascii" | "utf_8" | "utf_8_sig")
                && missing.all(|c| (0xdc80..0xdd00).contains(&c))
        }
        _ => false,
    }
}

/// The code points of a str held as UTF-8 with lone surrogates (each as three bytes).
pub(super) fn surrogate_str_chars(bytes: &[u8]) -> impl Iterator<Item = u32> + '_ {
    let mut rest = bytes;
    std::iter::from_fn(move || {
        let (&first, _) = rest.split_first()?;
        let len = match first {
            0x00..=0x7f => 1,
            0xc0..=0xdf => 2,
            0xe0..=0xef => 3,
            _ => 4,
        }
        .min(rest.len());
        let (head, tail) = rest.split_at(len);
        rest = tail;
        let mut c = u32::from(first) & (0x7f >> len.min(4));
        if len == 1 {
            c = u32::from(first);
        }
        for &b in &head[1..] {
            c = (c << 6) | u32::from(b & 0x3f);
        }
        Some(c)
    })
}

/// Whether `value` is bytes, or a call that makes bytes as protocol 2 spells them.
pub(super) fn made_bytes(value: &Value) -> bool {
    match value {
        Value::Bytes(_) => true,
        Value::Object(o) => matches!(
            &o.callable,
            Value::Global(g) if matches!(
                (g.module.as_str(), g.name.as_str()),
                ("_codecs", "encode") | ("builtins", "bytearray")
            )
        ),
        _ => false,
    }
}

/// The codecs of the `encodings` package that encode bytes to bytes.
pub(super) const BYTES_CODECS: &[&str] = &[
    "base64_codec",
    "bz2_codec",
    "hex_codec",
    "quopri_codec",
    "uu_codec",
    "zlib_codec",
];

/// The module of the `encodings` package that `codecs.lookup(name)` finds in Python 3.11, if any:
/// the name lowercased and normalized as `encodings.normalize_encoding` does, then an alias or a
/// module name.
pub(super) fn python_codec(name: &str) -> Option<&'static str> {
    let mut norm = String::with_capacity(name.len());
    let mut punct = false;
    for c in name.chars() {
        if c.is_alphanumeric() || c == '.' {
            if punct && !norm.is_empty() {
                norm.push('_');
            }
            if c.is_ascii() {
                norm.push(c.to_ascii_lowercase());
            }
            punct = false;
        } else {
            punct = true;
        }
    }
    let alias = |n: &str| {
        PYTHON_CODEC_ALIASES
            .binary_search_by(|(a, _)| (*a).cmp(n))
            .ok()
            .map(|i| PYTHON_CODEC_ALIASES[i].1)
    };
    let aliased = alias(&norm).or_else(|| alias(&norm.replace('.', "_")));
    let module = |m: &str| PYTHON_CODECS.iter().copied().find(|&c| c == m);
    aliased.and_then(module).or_else(|| module(&norm))
}

// Generated from Python 3.11.7's `encodings` package.
/// The modules of Python's `encodings` package that `codecs.lookup` finds (Python 3.11, Linux).
pub(super) const PYTHON_CODECS: &[&str] = &[
    "ascii",
    "base64_codec",
    "big5",
    "big5hkscs",
    "bz2_codec",
    "charmap",
    "cp037",
    "cp1006",
    "cp1026",
    "cp1125",
    "cp1140",
    "cp1250",
    "cp1251",
    "cp1252",
    "cp1253",
    "cp1254",
    "cp1255",
    "cp1256",
    "cp1257",
    "cp1258",
    "cp273",
    "cp424",
    "cp437",
    "cp500",
    "cp720",
    "cp737",
    "cp775",
    "cp850",
    "cp852",
    "cp855",
    "cp856",
    "cp857",
    "cp858",
    "cp860",
    "cp861",
    "cp862",
    "cp863",
    "cp864",
    "cp865",
    "cp866",
    "cp869",
    "cp874",
    "cp875",
    "cp932",
    "cp949",
    "cp950",
    "euc_jis_2004",
    "euc_jisx0213",
    "euc_jp",
    "euc_kr",
    "gb18030",
    "gb2312",
    "gbk",
    "hex_codec",
    "hp_roman8",
    "hz",
    "idna",
    "iso2022_jp",
    "iso2022_jp_1",
    "iso2022_jp_2",
    "iso2022_jp_2004",
    "iso2022_jp_3",
    "iso2022_jp_ext",
    "iso2022_kr",
    "iso8859_1",
    "iso8859_10",
    "iso8859_11",
    "iso8859_13",
    "iso8859_14",
    "iso8859_15",
    "iso8859_16",
    "iso8859_2",
    "iso8859_3",
    "iso8859_4",
    "iso8859_5",
    "iso8859_6",
    "iso8859_7",
    "iso8859_8",
    "iso8859_9",
    "johab",
    "koi8_r",
    "koi8_t",
    "koi8_u",
    "kz1048",
    "latin_1",
    "mac_arabic",
    "mac_croatian",
    "mac_cyrillic",
    "mac_farsi",
    "mac_greek",
    "mac_iceland",
    "mac_latin2",
    "mac_roman",
    "mac_romanian",
    "mac_turkish",
    "palmos",
    "ptcp154",
    "punycode",
    "quopri_codec",
    "raw_unicode_escape",
    "rot_13",
    "shift_jis",
    "shift_jis_2004",
    "shift_jisx0213",
    "tis_620",
    "undefined",
    "unicode_escape",
    "utf_16",
    "utf_16_be",
    "utf_16_le",
    "utf_32",
    "utf_32_be",
    "utf_32_le",
    "utf_7",
    "utf_8",
    "utf_8_sig",
    "uu_codec",
    "zlib_codec",
];
/// `encodings.aliases.aliases`: a normalized name and the module it means, sorted by name.
pub(super) const PYTHON_CODEC_ALIASES: &[(&str, &str)] = &[
    ("037", "cp037"),
    ("1026", "cp1026"),
    ("1125", "cp1125"),
    ("1140", "cp1140"),
    ("1250", "cp1250"),
    ("1251", "cp1251"),
    ("1252", "cp1252"),
    ("1253", "cp1253"),
    ("1254", "cp1254"),
    ("1255", "cp1255"),
    ("1256", "cp1256"),
    ("1257", "cp1257"),
    ("1258", "cp1258"),
    ("273", "cp273"),
    ("424", "cp424"),
    ("437", "cp437"),
    ("500", "cp500"),
    ("646", "ascii"),
    ("775", "cp775"),
    ("850", "cp850"),
    ("852", "cp852"),
    ("855", "cp855"),
    ("857", "cp857"),
    ("858", "cp858"),
    ("860", "cp860"),
    ("861", "cp861"),
    ("862", "cp862"),
    ("863", "cp863"),
    ("864", "cp864"),
    ("865", "cp865"),
    ("866", "cp866"),
    ("869", "cp869"),
    ("8859", "latin_1"),
    ("932", "cp932"),
    ("936", "gbk"),
    ("949", "cp949"),
    ("950", "cp950"),
    ("ansi", "mbcs"),
    ("ansi_x3.4_1968", "ascii"),
    ("ansi_x3.4_1986", "ascii"),
    ("ansi_x3_4_1968", "ascii"),
    ("arabic", "iso8859_6"),
    ("asmo_708", "iso8859_6"),
    ("base64", "base64_codec"),
    ("base_64", "base64_codec"),
    ("big5_hkscs", "big5hkscs"),
    ("big5_tw", "big5"),
    ("bz2", "bz2_codec"),
    ("chinese", "gb2312"),
    ("cp1051", "hp_roman8"),
    ("cp1361", "johab"),
    ("cp154", "ptcp154"),
    ("cp367", "ascii"),
    ("cp65001", "utf_8"),
    ("cp819", "latin_1"),
    ("cp866u", "cp1125"),
    ("cp936", "gbk"),
    ("cp_gr", "cp869"),
    ("cp_is", "cp861"),
    ("csHPRoman8", "hp_roman8"),
    ("csascii", "ascii"),
    ("csbig5", "big5"),
    ("csibm037", "cp037"),
    ("csibm1026", "cp1026"),
    ("csibm273", "cp273"),
    ("csibm424", "cp424"),
    ("csibm500", "cp500"),
    ("csibm855", "cp855"),
    ("csibm857", "cp857"),
    ("csibm858", "cp858"),
    ("csibm860", "cp860"),
    ("csibm861", "cp861"),
    ("csibm863", "cp863"),
    ("csibm864", "cp864"),
    ("csibm865", "cp865"),
    ("csibm866", "cp866"),
    ("csibm869", "cp869"),
    ("csiso2022jp", "iso2022_jp"),
    ("csiso2022kr", "iso2022_kr"),
    ("csiso58gb231280", "gb2312"),
    ("csisolatin1", "latin_1"),
    ("csisolatin2", "iso8859_2"),
    ("csisolatin3", "iso8859_3"),
    ("csisolatin4", "iso8859_4"),
    ("csisolatin5", "iso8859_9"),
    ("csisolatin6", "iso8859_10"),
    ("csisolatinarabic", "iso8859_6"),
    ("csisolatincyrillic", "iso8859_5"),
    ("csisolatingreek", "iso8859_7"),
    ("csisolatinhebrew", "iso8859_8"),
    ("cskoi8r", "koi8_r"),
    ("cspc775baltic", "cp775"),
    ("cspc850multilingual", "cp850"),
    ("cspc862latinhebrew", "cp862"),
    ("cspc8codepage437", "cp437"),
    ("cspcp852", "cp852"),
    ("csptcp154", "ptcp154"),
    ("csshiftjis", "shift_jis"),
    ("cyrillic", "iso8859_5"),
    ("cyrillic_asian", "ptcp154"),
    ("dbcs", "mbcs"),
    ("ebcdic_cp_be", "cp500"),
    ("ebcdic_cp_ca", "cp037"),
    ("ebcdic_cp_ch", "cp500"),
    ("ebcdic_cp_he", "cp424"),
    ("ebcdic_cp_nl", "cp037"),
    ("ebcdic_cp_us", "cp037"),
    ("ebcdic_cp_wt", "cp037"),
    ("ecma_114", "iso8859_6"),
    ("ecma_118", "iso8859_7"),
    ("elot_928", "iso8859_7"),
    ("euc_cn", "gb2312"),
    ("euc_jis2004", "euc_jis_2004"),
    ("euccn", "gb2312"),
    ("eucgb2312_cn", "gb2312"),
    ("eucjis2004", "euc_jis_2004"),
    ("eucjisx0213", "euc_jisx0213"),
    ("eucjp", "euc_jp"),
    ("euckr", "euc_kr"),
    ("gb18030_2000", "gb18030"),
    ("gb2312_1980", "gb2312"),
    ("gb2312_80", "gb2312"),
    ("greek", "iso8859_7"),
    ("greek8", "iso8859_7"),
    ("hebrew", "iso8859_8"),
    ("hex", "hex_codec"),
    ("hkscs", "big5hkscs"),
    ("hz_gb", "hz"),
    ("hz_gb_2312", "hz"),
    ("hzgb", "hz"),
    ("ibm037", "cp037"),
    ("ibm039", "cp037"),
    ("ibm1026", "cp1026"),
    ("ibm1051", "hp_roman8"),
    ("ibm1125", "cp1125"),
    ("ibm1140", "cp1140"),
    ("ibm273", "cp273"),
    ("ibm367", "ascii"),
    ("ibm424", "cp424"),
    ("ibm437", "cp437"),
    ("ibm500", "cp500"),
    ("ibm775", "cp775"),
    ("ibm819", "latin_1"),
    ("ibm850", "cp850"),
    ("ibm852", "cp852"),
    ("ibm855", "cp855"),
    ("ibm857", "cp857"),
    ("ibm858", "cp858"),
    ("ibm860", "cp860"),
    ("ibm861", "cp861"),
    ("ibm862", "cp862"),
    ("ibm863", "cp863"),
    ("ibm864", "cp864"),
    ("ibm865", "cp865"),
    ("ibm866", "cp866"),
    ("ibm869", "cp869"),
    ("iso2022jp", "iso2022_jp"),
    ("iso2022jp_1", "iso2022_jp_1"),
    ("iso2022jp_2", "iso2022_jp_2"),
    ("iso2022jp_2004", "iso2022_jp_2004"),
    ("iso2022jp_3", "iso2022_jp_3"),
    ("iso2022jp_ext", "iso2022_jp_ext"),
    ("iso2022kr", "iso2022_kr"),
    ("iso646_us", "ascii"),
    ("iso8859", "latin_1"),
    ("iso8859_1", "latin_1"),
    ("iso_2022_jp", "iso2022_jp"),
    ("iso_2022_jp_1", "iso2022_jp_1"),
    ("iso_2022_jp_2", "iso2022_jp_2"),
    ("iso_2022_jp_2004", "iso2022_jp_2004"),
    ("iso_2022_jp_3", "iso2022_jp_3"),
    ("iso_2022_jp_ext", "iso2022_jp_ext"),
    ("iso_2022_kr", "iso2022_kr"),
    ("iso_646.irv_1991", "ascii"),
    ("iso_8859_1", "latin_1"),
    ("iso_8859_10", "iso8859_10"),
    ("iso_8859_10_1992", "iso8859_10"),
    ("iso_8859_11", "iso8859_11"),
    ("iso_8859_11_2001", "iso8859_11"),
    ("iso_8859_13", "iso8859_13"),
    ("iso_8859_14", "iso8859_14"),
    ("iso_8859_14_1998", "iso8859_14"),
    ("iso_8859_15", "iso8859_15"),
    ("iso_8859_16", "iso8859_16"),
    ("iso_8859_16_2001", "iso8859_16"),
    ("iso_8859_1_1987", "latin_1"),
    ("iso_8859_2", "iso8859_2"),
    ("iso_8859_2_1987", "iso8859_2"),
    ("iso_8859_3", "iso8859_3"),
    ("iso_8859_3_1988", "iso8859_3"),
    ("iso_8859_4", "iso8859_4"),
    ("iso_8859_4_1988", "iso8859_4"),
    ("iso_8859_5", "iso8859_5"),
    ("iso_8859_5_1988", "iso8859_5"),
    ("iso_8859_6", "iso8859_6"),
    ("iso_8859_6_1987", "iso8859_6"),
    ("iso_8859_7", "iso8859_7"),
    ("iso_8859_7_1987", "iso8859_7"),
    ("iso_8859_8", "iso8859_8"),
    ("iso_8859_8_1988", "iso8859_8"),
    ("iso_8859_9", "iso8859_9"),
    ("iso_8859_9_1989", "iso8859_9"),
    ("iso_celtic", "iso8859_14"),
    ("iso_ir_100", "latin_1"),
    ("iso_ir_101", "iso8859_2"),
    ("iso_ir_109", "iso8859_3"),
    ("iso_ir_110", "iso8859_4"),
    ("iso_ir_126", "iso8859_7"),
    ("iso_ir_127", "iso8859_6"),
    ("iso_ir_138", "iso8859_8"),
    ("iso_ir_144", "iso8859_5"),
    ("iso_ir_148", "iso8859_9"),
    ("iso_ir_157", "iso8859_10"),
    ("iso_ir_166", "tis_620"),
    ("iso_ir_199", "iso8859_14"),
    ("iso_ir_226", "iso8859_16"),
    ("iso_ir_58", "gb2312"),
    ("iso_ir_6", "ascii"),
    ("jisx0213", "euc_jis_2004"),
    ("korean", "euc_kr"),
    ("ks_c_5601", "euc_kr"),
    ("ks_c_5601_1987", "euc_kr"),
    ("ks_x_1001", "euc_kr"),
    ("ksc5601", "euc_kr"),
    ("ksx1001", "euc_kr"),
    ("kz_1048", "kz1048"),
    ("l1", "latin_1"),
    ("l10", "iso8859_16"),
    ("l2", "iso8859_2"),
    ("l3", "iso8859_3"),
    ("l4", "iso8859_4"),
    ("l5", "iso8859_9"),
    ("l6", "iso8859_10"),
    ("l7", "iso8859_13"),
    ("l8", "iso8859_14"),
    ("l9", "iso8859_15"),
    ("latin", "latin_1"),
    ("latin1", "latin_1"),
    ("latin10", "iso8859_16"),
    ("latin2", "iso8859_2"),
    ("latin3", "iso8859_3"),
    ("latin4", "iso8859_4"),
    ("latin5", "iso8859_9"),
    ("latin6", "iso8859_10"),
    ("latin7", "iso8859_13"),
    ("latin8", "iso8859_14"),
    ("latin9", "iso8859_15"),
    ("mac_centeuro", "mac_latin2"),
    ("maccentraleurope", "mac_latin2"),
    ("maccyrillic", "mac_cyrillic"),
    ("macgreek", "mac_greek"),
    ("maciceland", "mac_iceland"),
    ("macintosh", "mac_roman"),
    ("maclatin2", "mac_latin2"),
    ("macroman", "mac_roman"),
    ("macturkish", "mac_turkish"),
    ("ms1361", "johab"),
    ("ms932", "cp932"),
    ("ms936", "gbk"),
    ("ms949", "cp949"),
    ("ms950", "cp950"),
    ("ms_kanji", "cp932"),
    ("mskanji", "cp932"),
    ("pt154", "ptcp154"),
    ("quopri", "quopri_codec"),
    ("quoted_printable", "quopri_codec"),
    ("quotedprintable", "quopri_codec"),
    ("r8", "hp_roman8"),
    ("rk1048", "kz1048"),
    ("roman8", "hp_roman8"),
    ("rot13", "rot_13"),
    ("ruscii", "cp1125"),
    ("s_jis", "shift_jis"),
    ("s_jis_2004", "shift_jis_2004"),
    ("s_jisx0213", "shift_jisx0213"),
    ("shiftjis", "shift_jis"),
    ("shiftjis2004", "shift_jis_2004"),
    ("shiftjisx0213", "shift_jisx0213"),
    ("sjis", "shift_jis"),
    ("sjis_2004", "shift_jis_2004"),
    ("sjisx0213", "shift_jisx0213"),
    ("strk1048_2002", "kz1048"),
    ("thai", "iso8859_11"),
    ("tis620", "tis_620"),
    ("tis_620_0", "tis_620"),
    ("tis_620_2529_0", "tis_620"),
    ("tis_620_2529_1", "tis_620"),
    ("u16", "utf_16"),
    ("u32", "utf_32"),
    ("u7", "utf_7"),
    ("u8", "utf_8"),
    ("u_jis", "euc_jp"),
    ("uhc", "cp949"),
    ("ujis", "euc_jp"),
    ("unicode_1_1_utf_7", "utf_7"),
    ("unicodebigunmarked", "utf_16_be"),
    ("unicodelittleunmarked", "utf_16_le"),
    ("us", "ascii"),
    ("us_ascii", "ascii"),
    ("utf", "utf_8"),
    ("utf16", "utf_16"),
    ("utf32", "utf_32"),
    ("utf7", "utf_7"),
    ("utf8", "utf_8"),
    ("utf8_ucs2", "utf_8"),
    ("utf8_ucs4", "utf_8"),
    ("utf_16be", "utf_16_be"),
    ("utf_16le", "utf_16_le"),
    ("utf_32be", "utf_32_be"),
    ("utf_32le", "utf_32_le"),
    ("uu", "uu_codec"),
    ("windows_1250", "cp1250"),
    ("windows_1251", "cp1251"),
    ("windows_1252", "cp1252"),
    ("windows_1253", "cp1253"),
    ("windows_1254", "cp1254"),
    ("windows_1255", "cp1255"),
    ("windows_1256", "cp1256"),
    ("windows_1257", "cp1257"),
    ("windows_1258", "cp1258"),
    ("x_mac_japanese", "shift_jis"),
    ("x_mac_korean", "euc_kr"),
    ("x_mac_simp_chinese", "gb2312"),
    ("x_mac_trad_chinese", "big5"),
    ("zip", "zlib_codec"),
    ("zlib", "zlib_codec"),
];

/// What `value` is, with its article, for messages.
pub(super) fn kind_name(value: &Value) -> &'static str {
    match value {
        Value::None => "None",
        Value::Bool(_) => "a bool",
        Value::Int(_) | Value::BigInt(_) => "an int",
        Value::Float(_) => "a float",
        Value::Str(_) | Value::SurrogateStr(_) => "a str",
        Value::Bytes(_) => "bytes",
        Value::Tuple(_) => "a tuple",
        Value::List(_) => "a list",
        Value::Dict(_) => "a dict",
        Value::Set(_) => "a set",
        Value::Global(_) => "a global",
        Value::Object(_) => "an object instance",
        Value::PersistentId(_) => "a persistent id",
    }
}

/// The globals `data.pkl` may name: tensor rebuild functions, storage and dtype names, and the
/// few classes plain data pickles through. Naming one runs nothing; the tree only records it.
pub struct TorchGlobals;

impl Globals for TorchGlobals {
    fn allows(&self, module: &str, name: &str) -> bool {
        if allows_global(module, name) {
            return true;
        }
        match module {
            "torch._utils" => matches!(
                name,
                "_rebuild_tensor_v2"
                    | "_rebuild_tensor_v3"
                    | "_rebuild_parameter"
                    | "_rebuild_parameter_with_state"
            ),
            "torch.storage" => name == "UntypedStorage",
            // Storage classes and dtypes ckpt cannot hold are let through so that the error can
            // say "unsupported dtype" rather than "not allowed".
            "torch" => {
                matches!(name, "Size" | "device")
                    || DType::from_storage_class(name).is_some()
                    || OTHER_STORAGE_CLASSES.contains(&name)
                    || DType::from_torch_name(name).is_some()
                    || OTHER_DTYPES.contains(&name)
            }
            // A `Counter` is read as the dict it is (see `counters_as_dicts`).
            "collections" => matches!(name, "OrderedDict" | "Counter"),
            // How protocol 2 spells bytes, sets and complex numbers.
            "_codecs" => name == "encode",
            // Not `frozenset`: torch's weights-only unpickler refuses it.
            "builtins" => matches!(name, "set" | "bytearray" | "complex"),
            _ => false,
        }
    }
}

/// [`TorchGlobals`] and the classes of an [`Extra`].
pub(super) struct WithExtra<'a>(pub(super) &'a dyn Globals);

impl Globals for WithExtra<'_> {
    fn allows(&self, module: &str, name: &str) -> bool {
        TorchGlobals.allows(module, name) || self.0.allows(module, name)
    }
}

/// `collections.Counter(d)` (how a Counter pickles: `REDUCE` of the class on one dict), or an
/// empty `Counter()`, as the dict it is; torch's weights-only reader loads it, and a dict of the
/// same items compares equal to it. Any other Counter is left for [`check_calls`] to refuse.
pub(super) fn counter_as_dict(object: &Object) -> Option<Value> {
    if object.callable.as_global() != Some(("collections", "Counter"))
        || object.new_obj
        || object.state.is_some()
        || !object.dict_items.is_empty()
        || !object.list_items.is_empty()
    {
        return None;
    }
    match object.args.as_slice() {
        [] => Some(Value::Dict(Vec::new())),
        [items @ Value::Dict(_)] => Some(items.clone()),
        _ => None,
    }
}

/// `value` with every object `plain` turns into data replaced by it, depth first.
pub(super) fn replace_objects(value: Value, plain: &dyn Fn(&Object) -> Option<Value>) -> Value {
    match value {
        Value::Object(object) => match plain(&object) {
            Some(v) => replace_objects(v, plain),
            None => Value::Object(object).map_children(&mut |v| replace_objects(v, plain)),
        },
        other => other.map_children(&mut |v| replace_objects(v, plain)),
    }
}

/// torch storage classes for dtypes ckpt does not support.
pub(super) const OTHER_STORAGE_CLASSES: &[&str] = &[
    "QInt8Storage",
    "QUInt8Storage",
    "QInt32Storage",
    "QUInt4x2Storage",
    "QUInt2x4Storage",
];

/// torch dtypes ckpt does not support (a saved `torch.bits8` in plain data is still fine).
pub(super) const OTHER_DTYPES: &[&str] = &[
    "bcomplex32",
    "bits1x8",
    "bits2x4",
    "bits4x2",
    "qint8",
    "quint8",
    "qint32",
    "quint4x2",
    "quint2x4",
    "bits8",
    "bits16",
    "uint1",
    "uint2",
    "uint3",
    "uint4",
    "uint5",
    "uint6",
    "uint7",
    "int1",
    "int2",
    "int3",
    "int4",
    "int5",
    "int6",
    "int7",
];
