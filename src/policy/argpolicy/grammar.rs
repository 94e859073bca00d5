//! Command-line grammars: what a tool's own option parser makes of an argv.
//!
//! Owns: turning an argv into the options (by canonical name) and operands the tool will see,
//! the way that tool's parser does — unique prefixes of long options, `--opt=value` and
//! `--opt value`, bundled short options with attached or separate values, `--` and `-`, tar's
//! old-style key bundle — and listing every spelling a parser accepts for one option. Must not:
//! decide what is allowed (the tool modules do) or guess: an argument the grammar cannot resolve
//! exactly as the tool would is an error, never an operand.

use std::fmt;

/// Whether an option takes a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arity {
    None,
    /// `--opt=value`, `--opt value`, `-ovalue`, `-o value`.
    Required,
    /// Only attached: `--opt=value`, `-ovalue`.
    Optional,
}

/// One option of a tool.
#[derive(Debug)]
pub struct Opt {
    /// The canonical long name the policy judges ("" for a short-only option).
    pub long: &'static str,
    /// Other long names the parser treats as this same option.
    pub aliases: &'static [&'static str],
    pub short: Option<char>,
    /// Value of the long form.
    pub arity: Arity,
    /// Value of the short form.
    pub short_arity: Arity,
    /// Has a `--no-NAME` form (wget: a separate option without value; curl: exact name only).
    pub negatable: bool,
}

impl Opt {
    /// `--long`, or `-s` for a short-only option.
    pub fn canonical(&self) -> String {
        match (self.long, self.short) {
            ("", Some(c)) => format!("-{c}"),
            (l, _) => format!("--{l}"),
        }
    }

    fn names(&self) -> impl Iterator<Item = &'static str> {
        std::iter::once(self.long)
            .chain(self.aliases.iter().copied())
            .filter(|n| !n.is_empty())
    }
}

/// How a tool's parser reads options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    /// glibc `getopt_long` (and argp on top of it): options anywhere (permuting), `--` ends
    /// them, `-` is an operand; long names match exactly or by a unique prefix (names of one
    /// option are never ambiguous with each other); case-sensitive.
    Gnu,
    /// glibc `getopt_long_only`: like [`Style::Gnu`], but `-word` is tried as a long option first
    /// (unless it is `-c` for a valid short `c`), falling back to short options when no long
    /// name matches; any two prefix matches are ambiguous.
    GnuLongOnly,
    /// curl's own parser (`tool_getparam.c`): long names case-insensitive, exact or a prefix
    /// shared with no other table entry; `--no-NAME` only for booleans, exact; no `=value`
    /// form (a value is always the next argument); `-` alone is an unknown option.
    Curl,
}

/// A tool's options and parser.
#[derive(Debug)]
pub struct Grammar {
    /// The tool and version the table was taken from, for messages.
    pub tool: &'static str,
    pub style: Style,
    pub opts: &'static [Opt],
    /// tar: a first argument without a leading dash is a bundle of short keys whose values
    /// are the following arguments, in order (`tar xvf a.tar`).
    pub old_style_keys: bool,
    /// A harmless short option without value, used to build bundled spellings.
    pub bundle_with: char,
}

/// One option occurrence, as the tool parses it.
#[derive(Debug, Clone)]
pub struct Parsed<'a> {
    pub opt: &'static Opt,
    /// `--no-NAME`.
    pub negated: bool,
    pub value: Option<&'a str>,
    /// The value was the next argument (not attached to the option).
    pub separate: bool,
    /// The argument as written.
    pub spelled: &'a str,
}

/// An argv element as the tool sees it.
#[derive(Debug, Clone)]
pub enum Item<'a> {
    Opt(Parsed<'a>),
    Operand(&'a str),
}

/// An argument the grammar cannot resolve the way the tool would; the tool rejects it too,
/// and the policy refuses it rather than guess.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParseError {
    Unknown(String),
    Ambiguous(String, Vec<String>),
    MissingValue(String),
    UnexpectedValue(String),
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParseError::Unknown(a) => write!(f, "'{a}' is not an option it knows"),
            ParseError::Ambiguous(a, c) => {
                write!(f, "'{a}' is ambiguous (could be {})", c.join(", "))
            }
            ParseError::MissingValue(a) => write!(f, "'{a}' needs a value"),
            ParseError::UnexpectedValue(a) => write!(f, "'{a}' takes no value"),
        }
    }
}

/// What a long name resolves to.
#[derive(Debug, Clone, Copy)]
struct Resolved {
    opt: &'static Opt,
    negated: bool,
}

enum Lookup {
    Found(Resolved),
    NotFound,
    Ambiguous(Vec<String>),
}

impl Grammar {
    pub fn short(&self, c: char) -> Option<&'static Opt> {
        self.opts.iter().find(|o| o.short == Some(c))
    }

    /// Every (name, option, negated) entry the parser's long table holds.
    fn entries(&self) -> Vec<(String, Resolved)> {
        let mut out = Vec::new();
        for opt in self.opts {
            for n in opt.names() {
                out.push((
                    n.to_string(),
                    Resolved {
                        opt,
                        negated: false,
                    },
                ));
                // wget builds a separate `no-NAME` getopt entry for each boolean; curl strips
                // `no-` before looking up (see `lookup_curl`).
                if opt.negatable && self.style != Style::Curl {
                    out.push((format!("no-{n}"), Resolved { opt, negated: true }));
                }
            }
        }
        out
    }

    fn lookup(&self, name: &str) -> Lookup {
        match self.style {
            Style::Curl => self.lookup_curl(name),
            Style::Gnu | Style::GnuLongOnly => self.lookup_getopt(name),
        }
    }

    fn lookup_getopt(&self, name: &str) -> Lookup {
        let entries = self.entries();
        if let Some((_, r)) = entries.iter().find(|(n, _)| n == name) {
            return Lookup::Found(*r);
        }
        let hits: Vec<&(String, Resolved)> = entries
            .iter()
            .filter(|(n, _)| n.starts_with(name))
            .collect();
        let Some((_, first)) = hits.first() else {
            return Lookup::NotFound;
        };
        // getopt_long: a second prefix match is ambiguous unless it is the same option (argp
        // aliases share one key); getopt_long_only treats every second match as ambiguous.
        let same = |r: &Resolved| std::ptr::eq(r.opt, first.opt) && r.negated == first.negated;
        if hits.len() > 1
            && (self.style == Style::GnuLongOnly || hits.iter().any(|(_, r)| !same(r)))
        {
            return Lookup::Ambiguous(hits.iter().map(|(n, _)| format!("--{n}")).collect());
        }
        Lookup::Found(*first)
    }

    fn lookup_curl(&self, word: &str) -> Lookup {
        // `--no-NAME`: curl strips `no-` and then, because it still compares the original
        // length, only an exact (case-insensitive) name matches, and only a boolean may be
        // negated.
        if let Some(rest) = word.strip_prefix("no-") {
            return match self.opts.iter().find(|o| o.long.eq_ignore_ascii_case(rest)) {
                Some(opt) if opt.negatable => Lookup::Found(Resolved { opt, negated: true }),
                _ => Lookup::NotFound,
            };
        }
        if let Some(opt) = self.opts.iter().find(|o| o.long.eq_ignore_ascii_case(word)) {
            return Lookup::Found(Resolved {
                opt,
                negated: false,
            });
        }
        let lower = word.to_ascii_lowercase();
        let hits: Vec<&'static Opt> = self
            .opts
            .iter()
            .filter(|o| !o.long.is_empty() && o.long.to_ascii_lowercase().starts_with(&lower))
            .collect();
        match hits.as_slice() {
            [] => Lookup::NotFound,
            [opt] => Lookup::Found(Resolved {
                opt,
                negated: false,
            }),
            many => Lookup::Ambiguous(many.iter().map(|o| o.canonical()).collect()),
        }
    }

    /// Parses `args` (without the program name) the way the tool does.
    pub fn parse<'a>(&self, args: &'a [String]) -> Result<Vec<Item<'a>>, ParseError> {
        let mut items = Vec::new();
        let mut i = 0;
        if self.old_style_keys
            && let Some(keys) = args.first()
            && !keys.starts_with('-')
        {
            // tar explodes `xvf a.tar` into `-x -v -f a.tar`: each key that takes a value
            // takes the next unused argument, in order.
            let mut next = 1;
            for c in keys.chars() {
                let opt = self
                    .short(c)
                    .ok_or_else(|| ParseError::Unknown(format!("{keys} (key '{c}')")))?;
                let value = if opt.short_arity == Arity::None {
                    None
                } else {
                    let v = args
                        .get(next)
                        .ok_or_else(|| ParseError::MissingValue(format!("{keys} (key '{c}')")))?;
                    next += 1;
                    Some(v.as_str())
                };
                items.push(Item::Opt(Parsed {
                    opt,
                    negated: false,
                    value,
                    separate: value.is_some(),
                    spelled: keys,
                }));
            }
            i = next;
        }
        let mut options_ended = false;
        while i < args.len() {
            let arg = args[i].as_str();
            i += 1;
            if options_ended || !arg.starts_with('-') {
                items.push(Item::Operand(arg));
                continue;
            }
            if arg == "--" {
                options_ended = true;
                continue;
            }
            if arg == "-" {
                if self.style == Style::Curl {
                    return Err(ParseError::Unknown(arg.into()));
                }
                items.push(Item::Operand(arg));
                continue;
            }
            if let Some(body) = arg.strip_prefix("--") {
                items.push(Item::Opt(self.long_option(arg, body, args, &mut i)?));
                continue;
            }
            let body = &arg[1..];
            if self.style == Style::GnuLongOnly {
                let mut chars = body.chars();
                let first = chars.next();
                let single_valid_short =
                    chars.next().is_none() && first.is_some_and(|c| self.short(c).is_some());
                if !single_valid_short {
                    let name = body.split_once('=').map_or(body, |(n, _)| n);
                    match self.lookup(name) {
                        Lookup::Found(_) => {
                            items.push(Item::Opt(self.long_option(arg, body, args, &mut i)?));
                            continue;
                        }
                        Lookup::Ambiguous(c) => return Err(ParseError::Ambiguous(arg.into(), c)),
                        Lookup::NotFound if first.is_some_and(|c| self.short(c).is_some()) => {}
                        Lookup::NotFound => return Err(ParseError::Unknown(arg.into())),
                    }
                }
            }
            self.cluster(arg, body, args, &mut i, &mut items)?;
        }
        Ok(items)
    }

    /// `--name`, `--name=value` (not curl) or `--name value`; `body` is `arg` without its dashes.
    fn long_option<'a>(
        &self,
        arg: &'a str,
        body: &'a str,
        args: &'a [String],
        i: &mut usize,
    ) -> Result<Parsed<'a>, ParseError> {
        let (name, attached) = match self.style {
            Style::Curl => (body, None),
            Style::Gnu | Style::GnuLongOnly => match body.split_once('=') {
                Some((n, v)) => (n, Some(v)),
                None => (body, None),
            },
        };
        let r = match self.lookup(name) {
            Lookup::Found(r) => r,
            Lookup::NotFound => return Err(ParseError::Unknown(arg.into())),
            Lookup::Ambiguous(c) => return Err(ParseError::Ambiguous(arg.into(), c)),
        };
        let arity = if r.negated { Arity::None } else { r.opt.arity };
        let (value, separate) = match (arity, attached) {
            (Arity::None, Some(_)) => return Err(ParseError::UnexpectedValue(arg.into())),
            (Arity::None, None) | (Arity::Optional, None) => (None, false),
            (_, Some(v)) => (Some(v), false),
            (Arity::Required, None) => {
                let v = args
                    .get(*i)
                    .ok_or_else(|| ParseError::MissingValue(arg.into()))?;
                *i += 1;
                (Some(v.as_str()), true)
            }
        };
        Ok(Parsed {
            opt: r.opt,
            negated: r.negated,
            value,
            separate,
            spelled: arg,
        })
    }

    /// `-abc`, `-ovalue`, `-o value`: letters until one takes a value.
    fn cluster<'a>(
        &self,
        arg: &'a str,
        body: &'a str,
        args: &'a [String],
        i: &mut usize,
        items: &mut Vec<Item<'a>>,
    ) -> Result<(), ParseError> {
        for (pos, c) in body.char_indices() {
            let opt = self
                .short(c)
                .ok_or_else(|| ParseError::Unknown(format!("{arg} (-{c})")))?;
            let rest = &body[pos + c.len_utf8()..];
            let (value, separate) = match opt.short_arity {
                Arity::None => (None, false),
                Arity::Optional if rest.is_empty() => (None, false),
                Arity::Required if rest.is_empty() => {
                    let v = args
                        .get(*i)
                        .ok_or_else(|| ParseError::MissingValue(format!("{arg} (-{c})")))?;
                    *i += 1;
                    (Some(v.as_str()), true)
                }
                Arity::Optional | Arity::Required => (Some(rest), false),
            };
            items.push(Item::Opt(Parsed {
                opt,
                negated: false,
                value,
                separate,
                spelled: arg,
            }));
            if value.is_some() {
                break;
            }
        }
        Ok(())
    }

    /// The option a single spelling (`--name`, `--na=v`, `-x`, tar key) names, for config
    /// `deny_args`.
    pub fn resolve_spelling(&self, spelling: &str) -> Result<&'static Opt, ParseError> {
        let unknown = || ParseError::Unknown(spelling.into());
        let (body, long) = if let Some(b) = spelling.strip_prefix("--") {
            (b, true)
        } else if let Some(b) = spelling.strip_prefix('-') {
            (b, false)
        } else {
            return Err(unknown());
        };
        let name = match self.style {
            Style::Curl => body,
            _ => body.split_once('=').map_or(body, |(n, _)| n),
        };
        let mut chars = body.chars();
        if !long && let (Some(c), None) = (chars.next(), chars.next()) {
            return self.short(c).ok_or_else(unknown);
        }
        if !long && self.style != Style::GnuLongOnly {
            return Err(unknown());
        }
        match self.lookup(name) {
            Lookup::Found(r) => Ok(r.opt),
            Lookup::NotFound => Err(unknown()),
            Lookup::Ambiguous(c) => Err(ParseError::Ambiguous(spelling.into(), c)),
        }
    }

    /// Every argv the tool parses as `opt` (with `value` where it takes one): each long name
    /// and each prefix of it the parser resolves to this option (and, for negatable options,
    /// the `--no-` forms), with attached and separate values; the short letter alone, with
    /// attached and separate values and bundled after another flag; tar's old-style keys.
    /// Property: the policy refuses every one of them when it refuses `opt`.
    pub fn spellings(&self, opt: &'static Opt, value: &str) -> Vec<Vec<String>> {
        let mut out: Vec<Vec<String>> = Vec::new();
        let resolves_to = |name: &str, negated: bool| match self.lookup(name) {
            Lookup::Found(r) => std::ptr::eq(r.opt, opt) && r.negated == negated,
            _ => false,
        };
        let mut long_forms = |dash: &str, name: &str, arity: Arity| match (self.style, arity) {
            (_, Arity::None) => out.push(vec![format!("{dash}{name}")]),
            (Style::Curl, _) => out.push(vec![format!("{dash}{name}"), value.to_string()]),
            (_, Arity::Optional) => {
                out.push(vec![format!("{dash}{name}")]);
                out.push(vec![format!("{dash}{name}={value}")]);
            }
            (_, Arity::Required) => {
                out.push(vec![format!("{dash}{name}={value}")]);
                out.push(vec![format!("{dash}{name}"), value.to_string()]);
            }
        };
        for name in opt.names() {
            let len = name.chars().count();
            for k in 1..=len {
                let prefix: String = name.chars().take(k).collect();
                if !resolves_to(&prefix, false) {
                    continue;
                }
                long_forms("--", &prefix, opt.arity);
                if self.style == Style::Curl && prefix.to_ascii_uppercase() != prefix {
                    long_forms("--", &prefix.to_ascii_uppercase(), opt.arity);
                }
                let single_short =
                    k == 1 && self.short(name.chars().next().unwrap_or('-')).is_some();
                if self.style == Style::GnuLongOnly && !single_short {
                    long_forms("-", &prefix, opt.arity);
                }
            }
            if opt.negatable {
                match self.style {
                    Style::Curl => long_forms("--", &format!("no-{name}"), Arity::None),
                    _ => {
                        let negated = format!("no-{name}");
                        for k in 1..=negated.chars().count() {
                            let prefix: String = negated.chars().take(k).collect();
                            if resolves_to(&prefix, true) {
                                long_forms("--", &prefix, Arity::None);
                            }
                        }
                    }
                }
            }
        }
        if let Some(c) = opt.short {
            let b = self.bundle_with;
            match opt.short_arity {
                Arity::None => {
                    out.push(vec![format!("-{c}")]);
                    out.push(vec![format!("-{b}{c}")]);
                    out.push(vec![format!("-{c}{b}")]);
                }
                Arity::Optional => {
                    out.push(vec![format!("-{c}")]);
                    out.push(vec![format!("-{c}{value}")]);
                    out.push(vec![format!("-{b}{c}{value}")]);
                }
                Arity::Required => {
                    out.push(vec![format!("-{c}{value}")]);
                    out.push(vec![format!("-{c}"), value.to_string()]);
                    out.push(vec![format!("-{b}{c}{value}")]);
                    out.push(vec![format!("-{b}{c}"), value.to_string()]);
                }
            }
            if self.old_style_keys {
                match opt.short_arity {
                    Arity::None => out.push(vec![format!("{b}{c}")]),
                    _ => out.push(vec![format!("{b}{c}"), value.to_string()]),
                }
            }
        }
        out
    }
}
