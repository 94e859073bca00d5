//! `filesystem.Filesystem` and `/files` on the data plane.
//!
//! Stat, MakeDir, Move, ListDir and Remove run inside the sandbox as the sandbox's user (a
//! short shell program, a background process of the session: confined, audited and with a
//! receipt like any run), so a path means what it means to the sandbox's own processes and
//! nothing of the host is reached. `/files` reads and writes files of the workspace through the
//! session's file calls (their size limits and `session_file` audit lines).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::body::Body;
use axum::extract::{FromRequest, Multipart, Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::connect::{self, Code, RpcError};
use super::pb::filesystem as pb;
use super::process::{quote, run_in};
use super::sandbox_path;
use super::{E2b, sandbox_of};
use crate::calls::caller::{BodyLimit, read_body};
use crate::execution::WORKSPACE;
use crate::sandbox::StreamKind;
use crate::sessions::Session;

/// `POST /filesystem.Filesystem/{method}`.
pub async fn call(
    State(e2b): State<Arc<E2b>>,
    Path(method): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let (session, body) = match super::admit(&e2b, &headers, body).await {
        Ok(admitted) => admitted,
        Err(refused) => return refused,
    };
    let call = Call {
        e2b: &e2b,
        headers: &headers,
        session,
    };
    match method.as_str() {
        "Stat" => connect::unary_answer(stat(&call, &body).await),
        "MakeDir" => connect::unary_answer(make_dir(&call, &body).await),
        "Move" => connect::unary_answer(move_entry(&call, &body).await),
        "ListDir" => connect::unary_answer(list_dir(&call, &body).await),
        "Remove" => connect::unary_answer(remove(&call, &body).await),
        _ => RpcError::new(
            Code::Unimplemented,
            format!("filesystem.Filesystem/{method} is not served (watchers are not offered)"),
        )
        .into_response(),
    }
}

/// A filesystem call: its sandbox and headers.
struct Call<'a> {
    e2b: &'a E2b,
    headers: &'a HeaderMap,
    session: Arc<Session>,
}

/// The longest a file operation's program may run.
const OP_TIMEOUT: Duration = Duration::from_secs(30);

/// How a file operation's program says why it failed (its exit code).
const NOT_FOUND: i64 = 3;
const EXISTS: i64 = 4;
const NOT_A_DIRECTORY: i64 = 5;

/// What `find -printf` prints of each entry, each field NUL-ended: type, size, permission bits
/// (octal), permissions (`ls -l`'s), owner, group, modified (seconds since the epoch), the
/// symlink's target, the path.
const ENTRY_FORMAT: &str = r"%y\0%s\0%m\0%M\0%u\0%g\0%T@\0%l\0%p\0";
const FIELDS: usize = 9;

/// Runs `program` with `args` as `$1…` in the caller's sandbox: its stdout, or its failure.
async fn op(call: &Call<'_>, program: &str, args: &[&str]) -> Result<Vec<u8>, RpcError> {
    let mut code = String::from("set -- ");
    for a in args {
        if a.contains('\0') {
            return Err(RpcError::invalid("a path may not contain NUL bytes"));
        }
        code.push_str(&quote(a));
        code.push(' ');
    }
    code.push('\n');
    code.push_str(program);
    let live = run_in(
        call.e2b,
        &call.session,
        call.headers,
        code,
        BTreeMap::new(),
        None,
        Some(OP_TIMEOUT),
    )
    .await?;
    let mut answer = live.answer();
    let answered = answer
        .wait_for(|a| a.is_some())
        .await
        .map_err(|_| RpcError::new(Code::Internal, "the file operation's run went away"))?
        .clone()
        .ok_or_else(|| RpcError::new(Code::Internal, "the file operation ended unanswered"))?;
    let v: serde_json::Value = serde_json::from_str(&answered.body).unwrap_or_default();
    let (_, stdout) = live.output_from(StreamKind::Stdout, 0, usize::MAX);
    let (_, stderr) = live.output_from(StreamKind::Stderr, 0, 4096);
    let stderr = String::from_utf8_lossy(&stderr).trim().to_string();
    if v["stdout_truncated"].as_bool() == Some(true) {
        return Err(RpcError::new(
            Code::ResourceExhausted,
            "the listing is larger than the profile's output cap",
        ));
    }
    let path = args.first().copied().unwrap_or("");
    match v["exit_code"].as_i64() {
        Some(0) if v["killed_reason"].is_null() => Ok(stdout),
        Some(NOT_FOUND) => Err(RpcError::not_found(format!("path '{path}' does not exist"))),
        Some(EXISTS) => Err(RpcError::new(
            Code::AlreadyExists,
            format!("path '{path}' already exists"),
        )),
        Some(NOT_A_DIRECTORY) => Err(RpcError::invalid(format!(
            "path '{path}' is not a directory"
        ))),
        Some(_) => Err(RpcError::new(
            Code::PermissionDenied,
            if stderr.is_empty() {
                format!("the operation on '{path}' failed")
            } else {
                stderr
            },
        )),
        None => Err(RpcError::new(
            Code::Unavailable,
            format!("the file operation did not run: {}", answered.body),
        )),
    }
}

/// The entries `find -printf` printed in [`ENTRY_FORMAT`].
fn entries(out: &[u8]) -> Vec<pb::EntryInfo> {
    let fields: Vec<String> = out
        .split(|b| *b == 0)
        .map(|f| String::from_utf8_lossy(f).into_owned())
        .collect();
    fields
        .chunks_exact(FIELDS)
        .map(|f| {
            let path = f[8].clone();
            let name = std::path::Path::new(&path)
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| path.clone());
            let (secs, frac) = f[6].split_once('.').unwrap_or((&f[6], "0"));
            let nanos = format!("{frac:0<9}")[..9].parse::<i32>().unwrap_or(0);
            pb::EntryInfo {
                name,
                r#type: match f[0].as_str() {
                    "f" => pb::FileType::File,
                    "d" => pb::FileType::Directory,
                    "l" => pb::FileType::Symlink,
                    _ => pb::FileType::Unspecified,
                } as i32,
                path,
                size: f[1].parse().unwrap_or(0),
                mode: u32::from_str_radix(&f[2], 8).unwrap_or(0),
                permissions: f[3].clone(),
                owner: f[4].clone(),
                group: f[5].clone(),
                modified_time: Some(pbjson_types::Timestamp {
                    seconds: secs.parse().unwrap_or(0),
                    nanos,
                }),
                symlink_target: (!f[7].is_empty()).then(|| f[7].clone()),
                metadata: Default::default(),
            }
        })
        .collect()
}

/// The program that prints the entry `$1`.
fn stat_program() -> String {
    format!(
        "[ -e \"$1\" ] || [ -L \"$1\" ] || exit {NOT_FOUND}\nexec find \"$1\" -maxdepth 0 -printf '{ENTRY_FORMAT}'\n"
    )
}

async fn one_entry(
    call: &Call<'_>,
    program: &str,
    args: &[&str],
) -> Result<pb::EntryInfo, RpcError> {
    let out = op(call, program, args).await?;
    entries(&out)
        .into_iter()
        .next()
        .ok_or_else(|| RpcError::new(Code::Internal, "the entry could not be read"))
}

async fn stat(call: &Call<'_>, body: &[u8]) -> Result<pb::StatResponse, RpcError> {
    let req: pb::StatRequest = connect::unary_request(call.headers, body)?;
    let path = sandbox_path(&req.path);
    let entry = one_entry(call, &stat_program(), &[&path]).await?;
    Ok(pb::StatResponse { entry: Some(entry) })
}

async fn make_dir(call: &Call<'_>, body: &[u8]) -> Result<pb::MakeDirResponse, RpcError> {
    let req: pb::MakeDirRequest = connect::unary_request(call.headers, body)?;
    let path = sandbox_path(&req.path);
    let program = format!(
        "[ -e \"$1\" ] && exit {EXISTS}\nmkdir -p -- \"$1\" || exit 1\n{}",
        stat_program()
    );
    let entry = one_entry(call, &program, &[&path]).await?;
    Ok(pb::MakeDirResponse { entry: Some(entry) })
}

async fn move_entry(call: &Call<'_>, body: &[u8]) -> Result<pb::MoveResponse, RpcError> {
    let req: pb::MoveRequest = connect::unary_request(call.headers, body)?;
    let (from, to) = (sandbox_path(&req.source), sandbox_path(&req.destination));
    let program = format!(
        "[ -e \"$1\" ] || [ -L \"$1\" ] || exit {NOT_FOUND}\nmv -T -- \"$1\" \"$2\" || exit 1\nset -- \"$2\"\n{}",
        stat_program()
    );
    let entry = one_entry(call, &program, &[&from, &to]).await?;
    Ok(pb::MoveResponse { entry: Some(entry) })
}

/// The deepest a listing goes.
const MAX_DEPTH: u32 = 64;

async fn list_dir(call: &Call<'_>, body: &[u8]) -> Result<pb::ListDirResponse, RpcError> {
    let req: pb::ListDirRequest = connect::unary_request(call.headers, body)?;
    let path = sandbox_path(&req.path);
    let depth = req.depth.clamp(1, MAX_DEPTH).to_string();
    let program = format!(
        "[ -e \"$1\" ] || exit {NOT_FOUND}\n[ -d \"$1\" ] || exit {NOT_A_DIRECTORY}\nexec find \"$1\" -mindepth 1 -maxdepth \"$2\" -printf '{ENTRY_FORMAT}'\n"
    );
    let out = op(call, &program, &[&path, &depth]).await?;
    let mut entries = entries(&out);
    entries.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(pb::ListDirResponse { entries })
}

async fn remove(call: &Call<'_>, body: &[u8]) -> Result<pb::RemoveResponse, RpcError> {
    let req: pb::RemoveRequest = connect::unary_request(call.headers, body)?;
    let path = sandbox_path(&req.path);
    let program =
        format!("[ -e \"$1\" ] || [ -L \"$1\" ] || exit {NOT_FOUND}\nexec rm -rf -- \"$1\"\n");
    op(call, &program, &[&path]).await?;
    Ok(pb::RemoveResponse {})
}

// ---------------------------------------------------------------------------------------------
// /files

/// envd's `/files` error body.
fn files_error(e: RpcError) -> Response {
    let status = e.status.unwrap_or(match e.code {
        Code::InvalidArgument => StatusCode::BAD_REQUEST,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    });
    let body = serde_json::json!({ "code": status.as_u16(), "message": e.message });
    (status, Json(body)).into_response()
}

/// The query of `/files`.
#[derive(Debug, Deserialize)]
pub struct FilesQuery {
    #[serde(default)]
    path: Option<String>,
    /// Whose home a relative path is in: every user's is the workspace here.
    #[serde(default)]
    #[allow(dead_code)]
    username: Option<String>,
}

/// The most files one multipart upload without `?path=` writes.
const MAX_PARTS: usize = 64;

/// `path` as a path of the workspace, relative to it (the session's file calls take those).
fn workspace_relative(path: &str) -> Result<String, RpcError> {
    let inside = sandbox_path(path);
    let rel = inside
        .strip_prefix(WORKSPACE)
        .and_then(|r| if r.is_empty() { Some(r) } else { r.strip_prefix('/') })
        .ok_or_else(|| {
            RpcError::invalid(format!(
                "'{path}' is outside the sandbox user's home ({WORKSPACE}, also /home/user): /files reads and writes files there"
            ))
        })?;
    Ok(rel.to_string())
}

fn api_error(session: &Session, e: crate::calls::ApiError) -> RpcError {
    let _ = session;
    e.into()
}

/// `GET /files?path=…`: a file's bytes.
pub async fn download(
    State(e2b): State<Arc<E2b>>,
    headers: HeaderMap,
    Query(q): Query<FilesQuery>,
) -> Response {
    let session = match sandbox_of(&e2b, &headers) {
        Ok(s) => s,
        Err(no) => return no.into_response(),
    };
    let served = async {
        let path = q
            .path
            .as_deref()
            .ok_or_else(|| RpcError::invalid("path is required"))?;
        let rel = workspace_relative(path)?;
        let permit = crate::calls::sessions::file_permit(&e2b.st).map_err(RpcError::from)?;
        let bytes = crate::calls::sessions::read_file(&e2b.st, &session, &rel)
            .await
            .map_err(|e| api_error(&session, e))?;
        // The permit goes with the bytes, to the last chunk a slow reader takes.
        Ok::<_, RpcError>(crate::calls::sessions::file_body(permit, bytes))
    };
    match served.await {
        Ok(body) => ([(header::CONTENT_TYPE, "application/octet-stream")], body).into_response(),
        Err(e) => files_error(e),
    }
}

/// `POST /files?path=…`: writes a file, from a multipart body (each `file` part; a part's
/// filename is its path when the query names none) or from the raw body
/// (`application/octet-stream`). Answers the entries written.
pub async fn upload(
    State(e2b): State<Arc<E2b>>,
    Query(q): Query<FilesQuery>,
    req: Request,
) -> Response {
    let headers = req.headers().clone();
    let session = match sandbox_of(&e2b, &headers) {
        Ok(s) => s,
        Err(no) => return no.into_response(),
    };
    let served = async {
        // A place among the file transfers first: no body is held without one.
        let permit = crate::calls::sessions::file_permit(&e2b.st).map_err(RpcError::from)?;
        let limit = BodyLimit::file(&e2b.st);
        let max = limit.bytes;
        let too_large = || RpcError {
            status: Some(StatusCode::PAYLOAD_TOO_LARGE),
            ..RpcError::new(
                Code::ResourceExhausted,
                format!("an upload is at most {max} bytes (sessions.max_file_bytes)"),
            )
        };
        let is_multipart = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("multipart/form-data"));
        let mut files: Vec<(String, Vec<u8>)> = Vec::new();
        if is_multipart {
            let read = async {
                let mut parts = Multipart::from_request(req, &())
                    .await
                    .map_err(|e| RpcError::invalid(e.body_text()))?;
                let failed = |e: axum::extract::multipart::MultipartError| {
                    if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                        too_large()
                    } else {
                        RpcError::invalid(e.body_text())
                    }
                };
                let mut total = 0usize;
                let most = if q.path.is_some() { 1 } else { MAX_PARTS };
                while let Some(mut part) = parts.next_field().await.map_err(failed)? {
                    if files.len() == most {
                        return Err(RpcError::invalid(format!(
                            "at most {most} file(s) in one upload ({})",
                            if most == 1 {
                                "path names one"
                            } else {
                                "its parts"
                            }
                        )));
                    }
                    let path = q
                        .path
                        .clone()
                        .or_else(|| part.file_name().map(str::to_string))
                        .ok_or_else(|| RpcError::invalid("path is required"))?;
                    // Checked before its bytes are read; it counts toward the upload's size.
                    workspace_relative(&path)?;
                    total += path.len();
                    let mut bytes = Vec::new();
                    while let Some(chunk) = part.chunk().await.map_err(failed)? {
                        total += chunk.len();
                        if total > max {
                            return Err(too_large());
                        }
                        bytes.extend_from_slice(&chunk);
                    }
                    files.push((path, bytes));
                }
                Ok::<_, RpcError>(())
            };
            tokio::time::timeout(limit.deadline, read)
                .await
                .map_err(|_| {
                    RpcError::new(Code::DeadlineExceeded, "the upload did not arrive in time")
                })??;
        } else {
            let path = q
                .path
                .clone()
                .ok_or_else(|| RpcError::invalid("path is required"))?;
            workspace_relative(&path)?;
            let bytes = read_body(req.into_body(), &headers, limit)
                .await
                .map_err(RpcError::from)?;
            files.push((path, bytes.to_vec()));
        }
        // Written on a task of its own: a client that goes away does not cut the writes short.
        let (st, session, rid) = (e2b.st.clone(), session.clone(), super::request_id(&headers));
        tokio::spawn(async move {
            let _held = permit;
            write_all(&st, &session, rid, files).await
        })
        .await
        .map_err(|e| RpcError::new(Code::Internal, e.to_string()))?
    };
    match served.await {
        Ok(written) => (StatusCode::OK, Json(written)).into_response(),
        Err(e) => files_error(e),
    }
}

/// Writes `files` (path, bytes) into `session`'s workspace, each with its audit line: the
/// entries written, as envd answers them.
async fn write_all(
    st: &crate::calls::AppState,
    session: &Session,
    rid: String,
    files: Vec<(String, Vec<u8>)>,
) -> Result<Vec<serde_json::Value>, RpcError> {
    let mut written = Vec::new();
    for (path, bytes) in files {
        let rel = workspace_relative(&path)?;
        crate::calls::sessions::upload(st, session, rid.clone(), &rel, bytes)
            .await
            .map_err(|e| api_error(session, e))?;
        let full = if rel.is_empty() {
            WORKSPACE.to_string()
        } else {
            format!("{WORKSPACE}/{rel}")
        };
        let name = std::path::Path::new(&full)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        written.push(serde_json::json!({ "name": name, "type": "file", "path": full }));
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn find_output_becomes_entries() {
        let out = b"f\x0012\x00644\x00-rw-r--r--\x00u\x00g\x001700000000.5000000000\x00\x00/workspace/a.txt\x00\
d\x004096\x00755\x00drwxr-xr-x\x00u\x00g\x001700000001\x00\x00/workspace/d\x00";
        let e = entries(out);
        assert_eq!(e.len(), 2);
        assert_eq!(e[0].name, "a.txt");
        assert_eq!(e[0].r#type, pb::FileType::File as i32);
        assert_eq!((e[0].size, e[0].mode), (12, 0o644));
        let t = e[0].modified_time.unwrap();
        assert_eq!((t.seconds, t.nanos), (1_700_000_000, 500_000_000));
        assert_eq!(e[1].r#type, pb::FileType::Directory as i32);
        assert!(e[1].symlink_target.is_none());
        let json = serde_json::to_value(&e[0]).unwrap();
        assert_eq!(json["type"], "FILE_TYPE_FILE");
        assert_eq!(json["size"], "12");
        let t = chrono::DateTime::parse_from_rfc3339(json["modifiedTime"].as_str().unwrap());
        assert_eq!(t.unwrap().timestamp_millis(), 1_700_000_000_500);
    }

    #[test]
    fn files_are_of_the_workspace() {
        assert_eq!(workspace_relative("a/b.txt").unwrap(), "a/b.txt");
        assert_eq!(workspace_relative("/home/user/x").unwrap(), "x");
        assert_eq!(workspace_relative("/workspace/y").unwrap(), "y");
        assert!(workspace_relative("/etc/passwd").is_err());
        assert!(workspace_relative("/workspacex").is_err());
    }
}
