//! python3: the interpreter's command line, as CPython 3.11 (`Python/getopt.c`, Debian 12's
//! 3.11.2) reads it: short options bundle (`-Im pip`, `-Impip`); `-c` and `-m` end the options,
//! their value being the rest of the bundle or the next argument; `--` ends the options and the
//! first other argument is the script; long options match exactly, their value is the next
//! argument. Refused: running pip (or ensurepip) as a module.

/// Short options without value (`J` is reserved and rejected by CPython, so it is unknown).
const FLAGS: &str = "bBdEhiIOPqRsStuvVx?";
/// Short options with a value.
const WITH_VALUE: &str = "cmWX";
const LONG_FLAGS: &[&str] = &[
    "--help",
    "--version",
    "--help-env",
    "--help-xoptions",
    "--help-all",
];
const LONG_WITH_VALUE: &[&str] = &["--check-hash-based-pycs"];
const REFUSED_MODULES: &[&str] = &["pip", "ensurepip"];

/// `Some(reason)` when python3 would run a refused module, or the argument is one CPython
/// rejects (fail closed).
pub fn check(args: &[String]) -> Option<String> {
    let mut i = 0;
    while let Some(arg) = args.get(i) {
        i += 1;
        if arg == "--" || arg == "-" || !arg.starts_with('-') {
            return None;
        }
        if arg.starts_with("--") {
            if LONG_WITH_VALUE.contains(&arg.as_str()) {
                i += 1;
            } else if !LONG_FLAGS.contains(&arg.as_str()) {
                return Some(format!(
                    "argument '{arg}' is not an option python3 knows (long options must be exact)"
                ));
            }
            continue;
        }
        for (pos, c) in arg.char_indices().skip(1) {
            if FLAGS.contains(c) {
                continue;
            }
            if !WITH_VALUE.contains(c) {
                return Some(format!(
                    "argument '{arg}' is not an option python3 knows (-{c})"
                ));
            }
            let rest = &arg[pos + c.len_utf8()..];
            let value = if rest.is_empty() {
                i += 1;
                args.get(i - 1).map(String::as_str).unwrap_or_default()
            } else {
                rest
            };
            match c {
                'c' => return None,
                'm' => return module_refusal(arg, value),
                _ => break,
            }
        }
    }
    None
}

fn module_refusal(arg: &str, module: &str) -> Option<String> {
    let top = module.split('.').next().unwrap_or_default();
    REFUSED_MODULES.contains(&top).then(|| {
        format!("argument '{arg}' runs module '{module}', which the argument policy refuses")
    })
}
