//! Build metadata for `executor_arm_build_info`: the commit the binary is built from; and the
//! E2B front end's envd messages, generated from `proto/envd` (see [`envd_messages`]).
//!
//! `EXECUTOR_ARM_GIT_SHA` from the environment wins (an image build has no `.git` in its
//! context and passes it as a build argument); otherwise `git rev-parse` in the source tree;
//! otherwise "unknown".

use std::process::Command;

fn main() {
    envd_messages();
    println!("cargo:rerun-if-env-changed=EXECUTOR_ARM_GIT_SHA");
    for path in [".git/HEAD", ".git/refs/heads", ".git/packed-refs"] {
        if std::path::Path::new(path).exists() {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    let sha = std::env::var("EXECUTOR_ARM_GIT_SHA")
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| {
            let out = Command::new("git")
                .args(["rev-parse", "--short=12", "HEAD"])
                .output()
                .ok()?;
            let sha = String::from_utf8(out.stdout).ok()?.trim().to_string();
            (out.status.success() && !sha.is_empty()).then_some(sha)
        })
        .unwrap_or_else(|| "unknown".to_string());
    // Only hex digits reach a label value: anything else from the environment is not a commit.
    let sha = if sha.bytes().all(|b| b.is_ascii_hexdigit()) && sha.len() <= 40 {
        sha
    } else {
        "unknown".to_string()
    };
    println!("cargo:rustc-env=EXECUTOR_ARM_GIT_SHA={sha}");
}

/// `proto/envd/*.proto` as prost types with pbjson's serde (the proto3 JSON mapping), into
/// `OUT_DIR`. protox parses the files, so no system `protoc` is needed.
fn envd_messages() {
    let protos = ["proto/envd/process.proto", "proto/envd/filesystem.proto"];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let fds = protox::compile(protos, ["proto/envd"]).expect("compile proto/envd");
    let descriptors = prost::Message::encode_to_vec(&fds);
    prost_build::Config::new()
        .compile_well_known_types()
        .extern_path(".google.protobuf", "::pbjson_types")
        .compile_fds(fds)
        .expect("generate the envd messages");
    pbjson_build::Builder::new()
        .register_descriptors(&descriptors)
        .expect("register the envd descriptors")
        .out_dir(&out)
        .build(&[".process", ".filesystem"])
        .expect("generate the envd messages' serde");
}
