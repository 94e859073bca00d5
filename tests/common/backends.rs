//! The three sandbox backends as test parameters, and [`on_every_backend!`](crate::on_every_backend),
//! which declares a case once and runs it on each: `local::<case>`, `docker::<case>` (runc) and
//! `gvisor::<case>` (runsc).
//!
//! The container cases need dockerd with the runc and runsc runtimes and the sandbox image
//! (`scripts/setup-docker.sh`, `scripts/build-sandbox-image.sh`). Without them they fail with a
//! message naming what is missing; they never skip.

/// The backend a case runs on, made the daemon's default with `SANDBOX_RUNTIME`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Local,
    Docker,
    Gvisor,
}

impl Backend {
    /// As the response's `backend` and `/capabilities` name it.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Local => "local",
            Backend::Docker => "docker",
            Backend::Gvisor => "gvisor",
        }
    }

    /// The daemon's `SANDBOX_RUNTIME`, which makes this backend the default one.
    pub fn runtime(self) -> &'static str {
        match self {
            Backend::Local => "local",
            Backend::Docker => "runc",
            Backend::Gvisor => "gvisor",
        }
    }

    pub fn is_container(self) -> bool {
        self != Backend::Local
    }

    /// Fails the test when a container backend's engine is missing.
    pub fn require(self, test: &str) {
        if self.is_container() {
            super::docker::require_docker(&format!("{test} on {self:?}"));
        }
    }
}

/// What a case hands back to its wrapper, which ends it after the case returned: a case that
/// checks its own clean-up returns `()`.
pub trait Finish {
    fn finish(self);
}

impl Finish for () {
    fn finish(self) {}
}

/// Declares each case (an `async fn case(backend: Backend) -> impl Finish` of the test crate's
/// root) as a test on every backend, in the modules `local`, `docker` and `gvisor`. An optional
/// leading `multi_thread;` runs the cases on tokio's multi-thread runtime.
#[macro_export]
macro_rules! on_every_backend {
    (multi_thread; $($case:ident),+ $(,)?) => {
        $crate::on_every_backend!(@all (flavor = "multi_thread"), $($case),+);
    };
    ($($case:ident),+ $(,)?) => {
        $crate::on_every_backend!(@all (), $($case),+);
    };
    (@all $flavor:tt, $($case:ident),+) => {
        $crate::on_every_backend!(@on local, Local, $flavor, $($case),+);
        $crate::on_every_backend!(@on docker, Docker, $flavor, $($case),+);
        $crate::on_every_backend!(@on gvisor, Gvisor, $flavor, $($case),+);
    };
    (@on $module:ident, $backend:ident, $flavor:tt, $($case:ident),+) => {
        mod $module {
            $(
                #[tokio::test $flavor]
                async fn $case() {
                    use $crate::common::backends::Finish as _;
                    let backend = $crate::common::backends::Backend::$backend;
                    backend.require(concat!(stringify!($module), "::", stringify!($case)));
                    super::$case(backend).await.finish();
                }
            )+
        }
    };
}
