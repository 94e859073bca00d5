use super::*;
use std::os::fd::AsFd;
use std::path::Path;

fn c(parts: &[&str]) -> Vec<Vec<u8>> {
    parts.iter().map(|p| p.as_bytes().to_vec()).collect()
}

#[test]
fn member_names_are_plain_relative_paths() {
    assert_eq!(member_path(b"a/b.txt").unwrap(), Some(c(&["a", "b.txt"])));
    assert_eq!(member_path(b"./a/").unwrap(), Some(c(&["a"])));
    assert_eq!(member_path(b"./").unwrap(), None);
    assert_eq!(member_path(b".").unwrap(), None);
    assert_eq!(member_path(b"..a/a..").unwrap(), Some(c(&["..a", "a.."])));
    for bad in [
        &b"/etc/passwd"[..],
        b"../x",
        b"a/../../x",
        b"a/..",
        b"a//b",
        b"a/./b",
        b"a\0b",
    ] {
        assert!(member_path(bad).is_err(), "{bad:?}");
    }
    assert!(member_path(&[b'x'; 256]).is_err());
    let deep = vec!["d"; MAX_DEPTH + 1].join("/");
    assert!(member_path(deep.as_bytes()).is_err());
}

#[test]
fn symlink_targets_must_resolve_inside_the_workspace_from_their_own_directory() {
    assert!(link_inside(&c(&["a", "b"]), b"../../x").is_ok());
    assert!(link_inside(&c(&["a", "b"]), b"../../../x").is_err());
    assert!(link_inside(&[], b"x/../y").is_ok());
    assert!(link_inside(&[], b"x/../../y").is_err());
    assert!(link_inside(&[], b"..").is_err());
    assert!(link_inside(&c(&["a"]), b"/etc/passwd").is_err());
    assert!(link_inside(&c(&["a"]), b"").is_err());
    assert!(link_inside(&c(&["a"]), b"./b/./c").is_ok());
}

#[test]
fn only_files_directories_and_inside_symlinks_without_special_bits_pass() {
    let up = ImportMode::Upload;
    let t = c(&["sub"]);
    assert_eq!(
        check_member(b'0', 0o644, 3, b"a/f", b"", &t, up).unwrap(),
        Some(Member {
            path: c(&["sub", "a", "f"]),
            kind: MemberKind::File {
                size: 3,
                mode: 0o644
            }
        })
    );
    assert_eq!(
        check_member(b'5', 0o500, 0, b"d/", b"", &t, up)
            .unwrap()
            .unwrap()
            .kind,
        MemberKind::Dir { mode: 0o700 },
        "directories stay writable by their owner"
    );
    assert_eq!(
        check_member(b'5', 0o755, 0, b"./", b"", &t, up).unwrap(),
        None
    );
    // `..` of the link's own directory is the target's, still inside the workspace.
    assert!(check_member(b'2', 0o777, 0, b"l", b"../x", &t, up).is_ok());
    assert!(check_member(b'2', 0o777, 0, b"l", b"../../x", &t, up).is_err());
    assert!(check_member(b'2', 0o777, 0, b"l", b"/etc", &t, up).is_err());
    assert!(check_member(b'2', 0o777, 0, b"l", b"/etc", &t, ImportMode::Restore).is_ok());
    for (ty, why) in [
        (b'1', "hard link"),
        (b'3', "device"),
        (b'4', "device"),
        (b'6', "FIFO"),
        (b'S', "sparse"),
        (b'7', "type"),
        (b'V', "type"),
    ] {
        let e = check_member(ty, 0o644, 0, b"x", b"y", &t, up).unwrap_err();
        assert!(e.contains(why), "{ty}: {e}");
    }
    for mode in [0o4755, 0o2755, 0o1777] {
        let e = check_member(b'0', mode, 0, b"x", b"", &t, up).unwrap_err();
        assert!(e.contains("setuid"), "{e}");
    }
    assert!(check_member(b'0', 0o644, 0, b"./", b"", &t, up).is_err());
    let staging = format!("{STAGING_PREFIX}x/f");
    assert!(check_member(b'0', 0o644, 0, staging.as_bytes(), b"", &[], up).is_err());
    assert!(check_member(b'0', 0o644, 0, staging.as_bytes(), b"", &t, up).is_ok());
    assert!(check_member(b'0', 0o644, 0, b"/abs", b"", &t, up).is_err());
    assert!(check_member(b'0', 0o644, 0, b"../up", b"", &t, up).is_err());
}

#[test]
fn pax_headers_may_name_but_not_resize_or_sparsify() {
    let rec = |k: &str, v: &str| {
        let body = format!(" {k}={v}\n");
        let mut n = body.len() + 1;
        if (n.to_string() + &body).len() != n {
            n += 1;
        }
        format!("{n}{body}")
    };
    let ok = rec("path", "long/name") + &rec("mtime", "1.5");
    assert_eq!(
        pax_names(ok.as_bytes()).unwrap(),
        (Some(b"long/name".to_vec()), None)
    );
    assert!(pax_names(rec("size", "99").as_bytes()).is_err());
    assert!(pax_names(rec("GNU.sparse.map", "0,1").as_bytes()).is_err());
}

/// A workspace in a temporary directory, and its root's descriptor.
struct Ws {
    dir: tempfile::TempDir,
    fd: OwnedFd,
}

fn ws() -> Ws {
    let dir = tempfile::tempdir().unwrap();
    let fd = subdir(
        nix::fcntl::open(dir.path(), OFlag::O_RDONLY, Mode::empty())
            .unwrap()
            .as_fd(),
        b".",
    )
    .unwrap();
    Ws { dir, fd }
}

/// A tar of (name, type, data-or-link) written with raw headers (names as given).
fn tar_of(members: &[(&str, u8, &str)]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (name, ty, data) in members {
        let mut h = tar::Header::new_old();
        h.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
        h.set_entry_type(tar::EntryType::new(*ty));
        h.set_mode(0o644);
        if *ty == b'2' || *ty == b'1' {
            h.set_link_name_literal(data).unwrap();
            h.set_size(0);
            h.set_cksum();
            b.append(&h, std::io::empty()).unwrap();
        } else {
            h.set_size(data.len() as u64);
            h.set_cksum();
            b.append(&h, data.as_bytes()).unwrap();
        }
    }
    b.into_inner().unwrap()
}

/// Every path below `dir` with its kind and content (files) or target (links).
fn snapshot(dir: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let p = e.path();
            let rel = p.strip_prefix(dir).unwrap().display().to_string();
            let t = e.file_type().unwrap();
            if t.is_symlink() {
                out.push((
                    rel,
                    format!("-> {}", std::fs::read_link(&p).unwrap().display()),
                ));
            } else if t.is_dir() {
                out.push((rel, "dir".into()));
                stack.push(p);
            } else {
                out.push((
                    rel,
                    String::from_utf8_lossy(&std::fs::read(&p).unwrap()).into(),
                ));
            }
        }
    }
    out.sort();
    out
}

fn upload(w: &Ws, target: &str, tar: &[u8]) -> Result<u64, ArchiveError> {
    let staged = stage(
        w.fd.as_fd(),
        &workspace_path(target).unwrap(),
        tar,
        ImportMode::Upload,
        None,
    )?;
    let n = staged.members;
    staged.commit()?;
    Ok(n)
}

#[test]
fn an_upload_round_trips_through_export() {
    let w = ws();
    std::fs::create_dir(w.dir.path().join("keep")).unwrap();
    std::fs::write(w.dir.path().join("keep/old"), "old").unwrap();
    let tar = tar_of(&[
        ("a/", b'5', ""),
        ("a/b/c.txt", b'0', "hello"),
        ("a/link", b'2', "b/c.txt"),
        ("keep/new", b'0', "new"),
    ]);
    assert_eq!(upload(&w, "", &tar).unwrap(), 4);
    let snap = snapshot(w.dir.path());
    assert_eq!(
        snap,
        [
            ("a", "dir"),
            ("a/b", "dir"),
            ("a/b/c.txt", "hello"),
            ("a/link", "-> b/c.txt"),
            ("keep", "dir"),
            ("keep/new", "new"),
            ("keep/old", "old"),
        ]
        .map(|(a, b)| (a.to_string(), b.to_string()))
    );
    // Out and back into an empty directory elsewhere: the same tree.
    let mut out = Vec::new();
    export(open_dir(w.fd.as_fd(), &[]).unwrap().as_fd(), &mut out).unwrap();
    let other = ws();
    let staged = stage(other.fd.as_fd(), &[], &out[..], ImportMode::Restore, None).unwrap();
    staged.commit().unwrap();
    assert_eq!(snapshot(other.dir.path()), snap);
    // A restore goes into an empty directory only.
    let again = stage(other.fd.as_fd(), &[], &out[..], ImportMode::Restore, None);
    assert!(matches!(again, Err(ArchiveError::Refused(_))), "{again:?}");
}

#[test]
fn hostile_archives_leave_the_workspace_as_it_was() {
    let w = ws();
    std::fs::write(w.dir.path().join("f"), "f").unwrap();
    std::fs::create_dir(w.dir.path().join("d")).unwrap();
    std::os::unix::fs::symlink("d", w.dir.path().join("into_d")).unwrap();
    std::os::unix::fs::symlink("/tmp", w.dir.path().join("out")).unwrap();
    let before = snapshot(w.dir.path());
    let mut truncated = tar_of(&[("x", b'0', &"y".repeat(2000))]);
    truncated.truncate(1024);
    let mut no_end = tar_of(&[("x", b'0', "y")]);
    no_end.truncate(1024);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "dotdot",
            tar_of(&[("ok", b'0', "1"), ("../evil", b'0', "x")]),
        ),
        (
            "absolute",
            tar_of(&[("ok", b'0', "1"), ("/tmp/evil", b'0', "x")]),
        ),
        (
            "link out then through",
            tar_of(&[("l", b'2', "../../tmp"), ("l/evil", b'0', "x")]),
        ),
        (
            "link in then through",
            tar_of(&[("l", b'2', "d"), ("l/evil", b'0', "x")]),
        ),
        (
            "through a workspace symlink",
            tar_of(&[("into_d/evil", b'0', "x")]),
        ),
        (
            "through a workspace symlink out",
            tar_of(&[("out/evil", b'0', "x")]),
        ),
        ("hard link", tar_of(&[("h", b'1', "f")])),
        ("fifo", tar_of(&[("p", b'6', "")])),
        ("device", tar_of(&[("dev", b'3', "")])),
        (
            "file over a directory",
            tar_of(&[("new", b'0', "1"), ("d", b'0', "x")]),
        ),
        (
            "directory over a file",
            tar_of(&[("new", b'0', "1"), ("f/", b'5', "")]),
        ),
        ("directory over a symlink", tar_of(&[("into_d/", b'5', "")])),
        ("truncated", truncated),
        ("no end block", no_end),
        ("not a tar", b"hello world".to_vec()),
        ("empty", Vec::new()),
    ];
    for (what, tar) in cases {
        let r = upload(&w, "", &tar);
        assert!(matches!(r, Err(ArchiveError::Refused(_))), "{what}: {r:?}");
        assert_eq!(snapshot(w.dir.path()), before, "{what}");
    }
    let mut setuid = tar::Header::new_gnu();
    setuid.set_path("s").unwrap();
    setuid.set_mode(0o4755);
    setuid.set_size(0);
    setuid.set_cksum();
    let mut b = tar::Builder::new(Vec::new());
    b.append(&setuid, std::io::empty()).unwrap();
    let r = upload(&w, "", &b.into_inner().unwrap());
    assert!(matches!(r, Err(ArchiveError::Refused(_))), "{r:?}");
    assert_eq!(snapshot(w.dir.path()), before);
}

#[test]
fn an_upload_below_a_path_makes_it_and_replaces_files() {
    let w = ws();
    std::fs::create_dir(w.dir.path().join("p")).unwrap();
    std::fs::write(w.dir.path().join("p/f"), "old").unwrap();
    upload(
        &w,
        "p/q",
        &tar_of(&[("x", b'0', "1"), ("up", b'2', "../f")]),
    )
    .unwrap();
    upload(&w, "p", &tar_of(&[("f", b'0', "new")])).unwrap();
    assert_eq!(
        std::fs::read_to_string(w.dir.path().join("p/f")).unwrap(),
        "new"
    );
    assert_eq!(
        std::fs::read_to_string(w.dir.path().join("p/q/up")).unwrap(),
        "new"
    );
    assert!(matches!(
        upload(&w, "p/q", &tar_of(&[("l", b'2', "../../../x")])),
        Err(ArchiveError::Refused(_))
    ));
    assert!(workspace_path("../x").is_err());
    assert!(workspace_path("/x").is_err());
    assert!(workspace_path("a/").is_err());
    assert_eq!(workspace_path("a/b").unwrap(), c(&["a", "b"]));
}
