//! Session pause and resume against workspaces a session's own code shapes, through a real
//! daemon on the local backend.

mod common;

use common::backends::Backend;
use common::docker::SOCKET;
use common::sessions::koder;
use common::{Daemon, Opts};
use serde_json::json;

fn opts() -> Opts {
    Opts {
        env: vec![("SANDBOX_RUNTIME".into(), Backend::Local.runtime().into())],
        config: Some(common::docker::config(1, SOCKET)),
        ..Default::default()
    }
}

fn path(id: &str, rest: &str) -> String {
    format!("/v1/sandbox/sessions/{id}{rest}")
}

/// A workspace whose files are hard links of one another fits its quota once; its saved tar
/// holds each link's data again. A pause that the resume cannot restore strands the session:
/// every call then fails, for as long as it stays paused. Such a workspace is either saved so
/// that it fits again, or its pause is refused while the session still runs.
#[tokio::test(flavor = "multi_thread")]
async fn a_paused_workspace_of_hard_links_can_be_resumed() {
    let d = Daemon::start_with(opts());
    let c = koder(&d, None);
    let r = c
        .create(json!({"language": "python", "limits": {"disk_mb": 16}, "capability_token": d.cap_all()}))
        .await;
    assert_eq!(r.status, 201, "{}", r.text);
    let id = r.json["id"].as_str().unwrap().to_string();
    // 10 MiB once on disk, linked under a second name (as `cp -al`, git or a package cache do).
    let wrote = c
        .exec(
            &id,
            json!({"code": "import os\nopen('a.bin','wb').write(os.urandom(10 << 20))\nos.link('a.bin','b.bin')\nprint('ok')",
                   "timeout_ms": 60000}),
        )
        .await;
    assert_eq!(wrote.status, 200, "{}", wrote.text);
    assert_eq!(wrote.json["stdout"], "ok\n", "{}", wrote.text);

    let paused = c.call("POST", &path(&id, "/pause"), None).await;
    if paused.status == 200 {
        let resumed = c.call("POST", &path(&id, "/resume"), None).await;
        assert_eq!(
            resumed.status, 200,
            "a session the daemon paused must come back: {}",
            resumed.text
        );
        let back = c
            .exec(
                &id,
                json!({"code": "import os\nprint(os.path.getsize('a.bin'), os.path.getsize('b.bin'))", "timeout_ms": 60000}),
            )
            .await;
        assert_eq!(back.status, 200, "{}", back.text);
        assert_eq!(back.json["stdout"], "10485760 10485760\n", "{}", back.text);
    } else {
        // Refused as a store without room: the session runs on with its workspace.
        assert_eq!(paused.status, 507, "{}", paused.text);
        assert_eq!(paused.json["error_type"], "StoreFull", "{}", paused.text);
        let still = c.call("GET", &path(&id, ""), None).await;
        assert_eq!(still.json["state"], "running", "{}", still.text);
    }
    assert_eq!(c.call("DELETE", &path(&id, ""), None).await.status, 204);
}
