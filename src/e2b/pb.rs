//! The envd messages (`proto/envd`), generated at build time: prost types with pbjson's serde.

#![allow(clippy::all, missing_docs, unreachable_pub, dead_code)]

pub mod process {
    include!(concat!(env!("OUT_DIR"), "/process.rs"));
    include!(concat!(env!("OUT_DIR"), "/process.serde.rs"));
}

pub mod filesystem {
    include!(concat!(env!("OUT_DIR"), "/filesystem.rs"));
    include!(concat!(env!("OUT_DIR"), "/filesystem.serde.rs"));
}
