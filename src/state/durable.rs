//! The embedded store: one redb file, `state.redb` under `state.dir`, that one daemon owns (redb
//! locks it: a second daemon on the same directory fails to start). What it acknowledges is
//! committed with an fsync before the call returns, so a `kill -9` at any point loses nothing a
//! caller was told: used single-use token ids, Idempotency-Key claims and answers and run
//! records all survive a restart, and a single-use token is refused only when it was used.
//!
//! Every record carries its expiry (unix milliseconds, wall clock, so it holds across restarts);
//! reads ignore expired records and each write transaction deletes a batch of them through an
//! expiry index, so the file stays bounded. Completed results and run records are held within
//! `state.idempotency_max_bytes` each, evicted as [`super::budget`] says; running claims are
//! never evicted (they lapse with their lease); a result larger than the whole budget is not
//! stored.
//!
//! Its record of used tokens begins when the file is created: a token that may have been issued
//! before then (a new pod, a file moved aside) is refused as [`JtiClaim::PredatesRecord`], as it
//! may have been used against the store that came before. Restarts on the same file keep that
//! first second, so they refuse nothing.
//!
//! At start the file is opened with redb's full integrity check and must carry this build's
//! schema version: a file that fails either is a startup error naming it, never a silent reset.
//! redb is synchronous: every call runs on tokio's blocking pool. Must not: interpret the
//! responses it stores.

use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use redb::{Database, ReadableDatabase, ReadableTable, Table, TableDefinition, TableHandle};

use super::budget::{ResultBudget, result_bytes};
use super::{
    IdemBegin, IdemKey, JtiClaim, StateError, StateStore, StoredExecution, StoredResponse,
};
use crate::auth::SingleUse;

/// The file under `state.dir`.
pub const FILE_NAME: &str = "state.redb";

/// The layout of the tables below. A file of another version is refused at start.
const SCHEMA_VERSION: u64 = 1;
const SCHEMA_KEY: &str = "schema_version";
/// The first unix second the file vouches for (set when it is created; see [`JtiClaim`]).
const SINCE_KEY: &str = "record_since";

const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
/// Single-use token replay keys -> kept until (unix ms).
const JTIS: TableDefinition<&str, u64> = TableDefinition::new("jtis");
/// Idempotency entries by [`IdemKey::scoped`] -> a JSON [`Record`].
const IDEM: TableDefinition<&str, &[u8]> = TableDefinition::new("idempotency");
/// Run records by [`IdemKey::scoped`] -> a JSON [`Record`] (its answer is the run's JSON).
const EXECS: TableDefinition<&str, &[u8]> = TableDefinition::new("executions");
/// (expiry in unix ms, a record's tagged key): what to delete when.
const EXPIRY: TableDefinition<(u64, &str), ()> = TableDefinition::new("expiry");

/// How long a starting daemon waits for the file's lock: the processes of a daemon killed a
/// moment ago (its prepared sandboxes hold a copy of its descriptors) release it as they die.
pub const LOCK_WAIT: Duration = Duration::from_secs(10);
/// Expired records deleted per write transaction (each write adds at most one).
const SWEEP_BATCH: usize = 64;
/// redb's page cache: the file's hot pages, not all of it.
const CACHE_BYTES: usize = 32 << 20;

/// Why the state file cannot be used.
#[derive(Debug, thiserror::Error)]
enum DbError {
    #[error(transparent)]
    Redb(#[from] redb::Error),
    #[error("undecodable record {key}: {source}")]
    Record {
        key: String,
        source: serde_json::Error,
    },
    #[error("undecodable expiry index entry {0}")]
    Index(String),
}

macro_rules! redb_errors {
    ($($t:ty),*) => {$(
        impl From<$t> for DbError {
            fn from(e: $t) -> Self {
                DbError::Redb(e.into())
            }
        }
    )*};
}
redb_errors!(
    redb::DatabaseError,
    redb::TransactionError,
    redb::TableError,
    redb::StorageError,
    redb::CommitError
);

/// Which table a record lives in; its tag prefixes its key in the expiry index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Jti,
    Idem,
    Exec,
}

impl Kind {
    fn tag(self) -> char {
        match self {
            Kind::Jti => 'j',
            Kind::Idem => 'i',
            Kind::Exec => 'e',
        }
    }

    fn tagged(self, key: &str) -> String {
        format!("{}:{key}", self.tag())
    }

    fn untag(tagged: &str) -> Option<(Kind, &str)> {
        let kind = match tagged.get(..2)? {
            "j:" => Kind::Jti,
            "i:" => Kind::Idem,
            "e:" => Kind::Exec,
            _ => return None,
        };
        Some((kind, &tagged[2..]))
    }
}

/// An idempotency entry or a run record.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Record {
    subject: String,
    /// Unix milliseconds; the record is gone from then on.
    expires_ms: u64,
    slot: Slot,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
enum Slot {
    Running {
        body_hash: String,
        owner: String,
    },
    Done {
        body_hash: String,
        response: StoredResponse,
        /// Completion order, for oldest-first eviction.
        seq: u64,
        bytes: usize,
    },
}

fn decode(key: &str, bytes: &[u8]) -> Result<Record, DbError> {
    serde_json::from_slice(bytes).map_err(|source| DbError::Record {
        key: key.to_string(),
        source,
    })
}

fn encode(r: &Record) -> Vec<u8> {
    // A struct of strings and numbers always serializes.
    serde_json::to_vec(r).unwrap_or_default()
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

fn after(now_ms: u64, d: Duration) -> u64 {
    now_ms.saturating_add(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The byte budgets of the completed results the file holds, counted in memory (rebuilt from the
/// file at start).
struct Budgets {
    idem: ResultBudget,
    execs: ResultBudget,
}

impl Budgets {
    fn new(max_bytes: usize) -> Self {
        Budgets {
            idem: ResultBudget::new(max_bytes),
            execs: ResultBudget::new(max_bytes),
        }
    }
}

/// What storing a completed result did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Completion {
    Stored,
    /// Larger than the whole budget: dropped, and the key released.
    TooLarge {
        bytes: usize,
    },
}

/// One write transaction's tables, and whether it changed anything (else it is not committed:
/// no fsync for a lookup).
struct Writer<'t> {
    jtis: Table<'t, &'static str, u64>,
    idem: Table<'t, &'static str, &'static [u8]>,
    execs: Table<'t, &'static str, &'static [u8]>,
    expiry: Table<'t, (u64, &'static str), ()>,
    budgets: &'t mut Budgets,
    now_ms: u64,
    dirty: bool,
}

impl<'t> Writer<'t> {
    fn open(
        txn: &'t redb::WriteTransaction,
        budgets: &'t mut Budgets,
        now_ms: u64,
    ) -> Result<Self, DbError> {
        Ok(Writer {
            jtis: txn.open_table(JTIS)?,
            idem: txn.open_table(IDEM)?,
            execs: txn.open_table(EXECS)?,
            expiry: txn.open_table(EXPIRY)?,
            budgets,
            now_ms,
            dirty: false,
        })
    }

    fn parts(
        &mut self,
        kind: Kind,
    ) -> (
        &mut Table<'t, &'static str, &'static [u8]>,
        &mut ResultBudget,
    ) {
        // Token ids have a table of their own (`jtis`), not a record table.
        match kind {
            Kind::Exec => (&mut self.execs, &mut self.budgets.execs),
            Kind::Idem | Kind::Jti => (&mut self.idem, &mut self.budgets.idem),
        }
    }

    /// Deletes up to `limit` records whose expiry passed; how many it deleted.
    fn sweep(&mut self, limit: usize) -> Result<usize, DbError> {
        let due: Vec<(u64, String)> = self
            .expiry
            .range::<(u64, &str)>(..(self.now_ms, ""))?
            .take(limit)
            .map(|e| e.map(|(k, _)| (k.value().0, k.value().1.to_string())))
            .collect::<Result<_, _>>()?;
        for (ms, tagged) in &due {
            self.expiry.remove((*ms, tagged.as_str()))?;
            self.dirty = true;
            let (kind, key) = Kind::untag(tagged).ok_or_else(|| DbError::Index(tagged.clone()))?;
            match kind {
                Kind::Jti => {
                    let live = self.jtis.get(key)?.is_some_and(|v| v.value() > self.now_ms);
                    if !live {
                        self.jtis.remove(key)?;
                    }
                }
                Kind::Idem | Kind::Exec => {
                    if self
                        .get(kind, key)?
                        .is_some_and(|r| r.expires_ms <= self.now_ms)
                    {
                        self.remove(kind, key)?;
                    }
                }
            }
        }
        Ok(due.len())
    }

    /// The record under `key`, expired or not.
    fn get(&mut self, kind: Kind, key: &str) -> Result<Option<Record>, DbError> {
        let (table, _) = self.parts(kind);
        let Some(v) = table.get(key)? else {
            return Ok(None);
        };
        decode(key, v.value()).map(Some)
    }

    /// The record under `key` unless it expired.
    fn live(&mut self, kind: Kind, key: &str) -> Result<Option<Record>, DbError> {
        let now = self.now_ms;
        Ok(self.get(kind, key)?.filter(|r| r.expires_ms > now))
    }

    fn remove(&mut self, kind: Kind, key: &str) -> Result<(), DbError> {
        let (table, budget) = self.parts(kind);
        let old = match table.remove(key)? {
            Some(g) => decode(key, g.value())?,
            None => return Ok(()),
        };
        if let Slot::Done { seq, bytes, .. } = &old.slot {
            budget.remove(&old.subject, *seq, *bytes);
        }
        self.expiry
            .remove((old.expires_ms, kind.tagged(key).as_str()))?;
        self.dirty = true;
        Ok(())
    }

    /// Stores `record` under `key`, replacing what was there.
    fn put(&mut self, kind: Kind, key: &str, record: &Record) -> Result<(), DbError> {
        self.remove(kind, key)?;
        let (table, _) = self.parts(kind);
        table.insert(key, encode(record).as_slice())?;
        self.expiry
            .insert((record.expires_ms, kind.tagged(key).as_str()), ())?;
        self.dirty = true;
        Ok(())
    }

    /// Evicts the budget's first victim; false when there is none.
    fn evict_one(&mut self, kind: Kind) -> Result<bool, DbError> {
        let (_, budget) = self.parts(kind);
        match budget.victim() {
            Some(k) => {
                self.remove(kind, &k)?;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Stores a completed result for `ttl` within the budget of `kind`, evicting as it must.
    fn complete(
        &mut self,
        kind: Kind,
        key: &IdemKey,
        body_hash: &str,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<Completion, DbError> {
        let scoped = key.scoped();
        self.remove(kind, &scoped)?;
        let bytes = result_bytes(&scoped, &key.subject, body_hash, &response.body);
        if self.parts(kind).1.too_large(bytes) {
            return Ok(Completion::TooLarge { bytes });
        }
        while self.parts(kind).1.overfull_with(bytes) && self.evict_one(kind)? {}
        let seq = self.parts(kind).1.add(&key.subject, &scoped, bytes);
        let record = Record {
            subject: key.subject.clone(),
            expires_ms: after(self.now_ms, ttl),
            slot: Slot::Done {
                body_hash: body_hash.to_string(),
                response: response.clone(),
                seq,
                bytes,
            },
        };
        // `put` finds nothing to remove (done above), so the count just added stays.
        let (table, _) = self.parts(kind);
        table.insert(scoped.as_str(), encode(&record).as_slice())?;
        self.expiry
            .insert((record.expires_ms, kind.tagged(&scoped).as_str()), ())?;
        self.dirty = true;
        Ok(Completion::Stored)
    }
}

struct Shared {
    db: Database,
    path: PathBuf,
    budgets: Mutex<Budgets>,
    /// `state.idempotency_max_bytes`: the bound of each budget.
    max_bytes: usize,
    /// The first unix second the file's record of used tokens covers.
    since: u64,
    /// Verification's clock leeway: a used token id is kept this long past its token's expiry.
    leeway_ms: u64,
}

impl Shared {
    /// Runs `op` in one write transaction (after a sweep), committed durably when it changed
    /// anything. On a failure the budgets are counted again from the file.
    fn write<T>(
        &self,
        op: impl FnOnce(&mut Writer<'_>) -> Result<T, DbError>,
    ) -> Result<T, DbError> {
        let mut budgets = self.budgets.lock().unwrap_or_else(|p| p.into_inner());
        let txn = self.db.begin_write()?;
        let done = {
            let attempt = Writer::open(&txn, &mut budgets, now_ms()).and_then(|mut w| {
                w.sweep(SWEEP_BATCH)?;
                let out = op(&mut w)?;
                Ok((out, w.dirty))
            });
            match attempt {
                Ok((out, true)) => txn.commit().map(|()| out).map_err(DbError::from),
                Ok((out, false)) => txn.abort().map(|()| out).map_err(DbError::from),
                Err(e) => {
                    drop(txn);
                    Err(e)
                }
            }
        };
        if done.is_err() {
            match count_budgets(&self.db, self.max_bytes) {
                Ok(b) => *budgets = b,
                Err(e) => {
                    tracing::error!(file = %self.path.display(), error = %e, "state file: results not counted again")
                }
            }
        }
        done
    }

    fn unavailable(&self, e: DbError) -> StateError {
        StateError::Unavailable(format!("state file {}: {e}", self.path.display()))
    }
}

/// Counts the completed results the file holds.
fn count_budgets(db: &Database, max_bytes: usize) -> Result<Budgets, DbError> {
    let mut budgets = Budgets::new(max_bytes);
    let txn = db.begin_read()?;
    for (def, budget) in [(IDEM, &mut budgets.idem), (EXECS, &mut budgets.execs)] {
        let table = txn.open_table(def)?;
        for entry in table.iter()? {
            let (k, v) = entry?;
            let r = decode(k.value(), v.value())?;
            if let Slot::Done { seq, bytes, .. } = r.slot {
                budget.restore(&r.subject, k.value(), seq, bytes);
            }
        }
    }
    Ok(budgets)
}

pub struct DurableStore {
    shared: Arc<Shared>,
}

/// What to tell an operator about a state file that cannot be used as it is.
const MOVE_ASIDE: &str = "executor-arm does not reset it: stop the daemon, move the file aside \
    and start again (the Idempotency-Key answers and run records in it are then forgotten; the new \
    file refuses single-use tokens issued before it was created)";

impl DurableStore {
    /// Opens (or creates) `dir/state.redb`, checks it, deletes what expired and counts what it
    /// holds. `idempotency_max_bytes` bounds the completed results and the run records each;
    /// `leeway_seconds` is the clock leeway token verification allows. A file another process
    /// holds is waited for up to `lock_wait` ([`LOCK_WAIT`] for the daemon).
    pub fn open(
        dir: &Path,
        idempotency_max_bytes: usize,
        leeway_seconds: u64,
        lock_wait: Duration,
    ) -> Result<DurableStore, StateError> {
        let path = dir.join(FILE_NAME);
        let fail = |reason: String| StateError::File {
            path: path.clone(),
            reason,
        };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| fail(format!("cannot create state.dir {}: {e}", dir.display())))?;
        let existed = path.exists();
        let started = std::time::Instant::now();
        let db = loop {
            // Its contents are answers of runs: the daemon's alone.
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .open(&path)
                .map_err(|e| fail(format!("cannot open: {e}")))?;
            match open_checked(file) {
                Ok(db) => break db,
                // The processes of a daemon killed a moment ago hold its lock until they are gone.
                Err(OpenFailure::InUse) if started.elapsed() < lock_wait => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(OpenFailure::InUse) => {
                    let holders = holders_of(&path);
                    return Err(fail(format!(
                        "in use by another process{} for {} ms (is another executor-arm daemon \
                         running with the same state.dir? give each daemon its own)",
                        if holders.is_empty() {
                            String::new()
                        } else {
                            format!(" (pid {})", holders.join(", "))
                        },
                        lock_wait.as_millis()
                    )));
                }
                Err(OpenFailure::Unusable(reason)) => return Err(fail(reason)),
            }
        };
        if !existed {
            // The new file's name is durable before anything in it is acknowledged.
            std::fs::File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| fail(format!("cannot sync state.dir {}: {e}", dir.display())))?;
        }
        let since = check_schema(&db, leeway_seconds).map_err(&fail)?;
        let shared = Shared {
            db,
            path: path.clone(),
            budgets: Mutex::new(Budgets::new(idempotency_max_bytes)),
            max_bytes: idempotency_max_bytes,
            since,
            leeway_ms: leeway_seconds.saturating_mul(1000),
        };
        let budgets = count_budgets(&shared.db, idempotency_max_bytes)
            .map_err(|e| fail(format!("unreadable ({e}); {MOVE_ASIDE}")))?;
        *shared.budgets.lock().unwrap_or_else(|p| p.into_inner()) = budgets;
        // Everything that expired while the daemon was down goes now, and a budget lowered since
        // the last start holds from the first request on.
        shared
            .write(|w| {
                while w.sweep(4096)? > 0 {}
                for kind in [Kind::Idem, Kind::Exec] {
                    while w.parts(kind).1.overfull_with(0) && w.evict_one(kind)? {}
                }
                Ok(())
            })
            .map_err(|e| fail(format!("unreadable ({e}); {MOVE_ASIDE}")))?;
        Ok(DurableStore {
            shared: Arc::new(shared),
        })
    }

    /// Runs `f` on the blocking pool: redb's calls wait on the disk.
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Shared) -> Result<T, DbError> + Send + 'static,
    ) -> Result<T, StateError> {
        let shared = self.shared.clone();
        let path = self.shared.path.clone();
        tokio::task::spawn_blocking(move || f(&shared).map_err(|e| shared.unavailable(e)))
            .await
            .map_err(|e| StateError::Unavailable(format!("state file {}: {e}", path.display())))?
    }
}

enum OpenFailure {
    /// Another process has the file open.
    InUse,
    Unusable(String),
}

/// Opens the file with redb's integrity check (every page's checksum; a file a crash left is
/// repaired from its last commit). A panic inside redb on a damaged file is an error too.
fn open_checked(file: std::fs::File) -> Result<Database, OpenFailure> {
    let opened = std::panic::catch_unwind(move || {
        Database::builder()
            .set_cache_size(CACHE_BYTES)
            .set_check_integrity_on_open(true)
            .create_with_backend(redb::backends::FileBackend::new(file)?)
    });
    match opened {
        Ok(Ok(db)) => Ok(db),
        Ok(Err(redb::DatabaseError::DatabaseAlreadyOpen)) => Err(OpenFailure::InUse),
        Ok(Err(redb::DatabaseError::UpgradeRequired(v))) => Err(OpenFailure::Unusable(format!(
            "written in redb file format {v}, which this build does not read; {MOVE_ASIDE}"
        ))),
        Ok(Err(e)) => Err(OpenFailure::Unusable(format!(
            "corrupt or unreadable ({e}); {MOVE_ASIDE}"
        ))),
        Err(_) => Err(OpenFailure::Unusable(format!(
            "corrupt (reading it failed); {MOVE_ASIDE}"
        ))),
    }
}

/// The pids that have `path` open (best effort, from /proc), for the message of a file in use.
fn holders_of(path: &Path) -> Vec<String> {
    let Ok(want) = std::fs::canonicalize(path) else {
        return Vec::new();
    };
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids: Vec<String> = procs
        .filter_map(Result::ok)
        .filter_map(|p| {
            let pid = p.file_name().into_string().ok()?;
            pid.bytes().all(|b| b.is_ascii_digit()).then_some(())?;
            let fds = std::fs::read_dir(p.path().join("fd")).ok()?;
            fds.filter_map(Result::ok)
                .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|l| l == want))
                .then_some(pid)
        })
        .collect();
    pids.sort();
    pids
}

/// A new file gets this build's schema version and the second its record begins; an existing
/// one must carry both. Returns that second.
fn check_schema(db: &Database, leeway_seconds: u64) -> Result<u64, String> {
    match stamp_schema(db, leeway_seconds) {
        Ok(Ok(since)) => Ok(since),
        Ok(Err(problem)) => Err(format!("{problem}; {MOVE_ASIDE}")),
        Err(e) => Err(format!("unreadable ({e}); {MOVE_ASIDE}")),
    }
}

/// The first second a record begun now vouches for: a token issued in the current second may
/// predate it, and verification accepts an `iat` up to the leeway ahead.
fn record_start(leeway_seconds: u64) -> u64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    now.as_secs() + u64::from(now.subsec_nanos() > 0) + leeway_seconds
}

/// Stamps a new file and creates its tables; the file's record start, or what is wrong with it.
fn stamp_schema(db: &Database, leeway_seconds: u64) -> Result<Result<u64, String>, DbError> {
    let txn = db.begin_write()?;
    let (version, since) = {
        let meta = txn.open_table(META)?;
        let version = meta.get(SCHEMA_KEY)?.map(|v| v.value());
        let since = meta.get(SINCE_KEY)?.map(|v| v.value());
        (version, since)
    };
    let since = match (version, since) {
        (Some(SCHEMA_VERSION), Some(since)) => since,
        (Some(SCHEMA_VERSION), None) => {
            return Ok(Err("no record start (not written by executor-arm?)".into()));
        }
        (Some(v), _) => {
            return Ok(Err(format!(
                "schema version {v}, and this build reads version {SCHEMA_VERSION} (written by \
                 another version of executor-arm)"
            )));
        }
        (None, _) => {
            let others = txn
                .list_tables()?
                .filter(|t| t.name() != META.name())
                .count();
            if others > 0 {
                return Ok(Err(
                    "tables without a schema version (not written by executor-arm?)".into(),
                ));
            }
            let since = record_start(leeway_seconds);
            let mut meta = txn.open_table(META)?;
            meta.insert(SCHEMA_KEY, SCHEMA_VERSION)?;
            meta.insert(SINCE_KEY, since)?;
            since
        }
    };
    txn.open_table(JTIS)?;
    txn.open_table(IDEM)?;
    txn.open_table(EXECS)?;
    txn.open_table(EXPIRY)?;
    txn.commit()?;
    Ok(Ok(since))
}

#[async_trait::async_trait]
impl StateStore for DurableStore {
    /// The file outlives the daemon: it is the record for every token issued since it was
    /// created.
    async fn claim_jti(&self, token: &SingleUse) -> Result<JtiClaim, StateError> {
        if token.may_predate(self.shared.since) {
            return Ok(JtiClaim::PredatesRecord {
                since: self.shared.since,
            });
        }
        let key = token.replay_key();
        let exp_ms = token.exp.saturating_mul(1000);
        self.blocking(move |s| {
            // Kept past the expiry by verification's leeway and a minute, like Redis does.
            let until = exp_ms.saturating_add(s.leeway_ms).saturating_add(60_000);
            s.write(|w| {
                let old = w.jtis.get(key.as_str())?.map(|v| v.value());
                match old {
                    Some(kept) if kept > w.now_ms => return Ok(JtiClaim::Replayed),
                    Some(kept) => {
                        w.expiry.remove((kept, Kind::Jti.tagged(&key).as_str()))?;
                    }
                    None => {}
                }
                w.jtis.insert(key.as_str(), until)?;
                w.expiry
                    .insert((until, Kind::Jti.tagged(&key).as_str()), ())?;
                w.dirty = true;
                Ok(JtiClaim::Claimed)
            })
        })
        .await
    }

    async fn release_jti(&self, token: &SingleUse) -> Result<(), StateError> {
        let key = token.replay_key();
        self.blocking(move |s| {
            s.write(|w| {
                if let Some(kept) = w.jtis.remove(key.as_str())?.map(|v| v.value()) {
                    w.expiry.remove((kept, Kind::Jti.tagged(&key).as_str()))?;
                    w.dirty = true;
                }
                Ok(())
            })
        })
        .await
    }

    async fn idempotency_begin(
        &self,
        key: &IdemKey,
        body_hash: &str,
        owner: &str,
        lease: Duration,
    ) -> Result<IdemBegin, StateError> {
        let (key, body_hash, owner) = (key.clone(), body_hash.to_string(), owner.to_string());
        self.blocking(move |s| {
            s.write(|w| {
                let scoped = key.scoped();
                Ok(match w.live(Kind::Idem, &scoped)?.map(|r| r.slot) {
                    Some(Slot::Running { body_hash: h, .. }) => IdemBegin::InProgress {
                        same_body: h == body_hash,
                    },
                    Some(Slot::Done {
                        body_hash: h,
                        response,
                        ..
                    }) => IdemBegin::Done {
                        same_body: h == body_hash,
                        response,
                    },
                    None => {
                        let record = Record {
                            subject: key.subject.clone(),
                            expires_ms: after(w.now_ms, lease),
                            slot: Slot::Running { body_hash, owner },
                        };
                        w.put(Kind::Idem, &scoped, &record)?;
                        IdemBegin::Started
                    }
                })
            })
        })
        .await
    }

    async fn idempotency_renew(
        &self,
        key: &IdemKey,
        owner: &str,
        lease: Duration,
    ) -> Result<bool, StateError> {
        let (scoped, owner) = (key.scoped(), owner.to_string());
        self.blocking(move |s| {
            s.write(|w| match w.live(Kind::Idem, &scoped)? {
                Some(mut r) if matches!(&r.slot, Slot::Running { owner: o, .. } if *o == owner) => {
                    r.expires_ms = after(w.now_ms, lease);
                    w.put(Kind::Idem, &scoped, &r)?;
                    Ok(true)
                }
                _ => Ok(false),
            })
        })
        .await
    }

    async fn idempotency_complete(
        &self,
        key: &IdemKey,
        body_hash: &str,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<(), StateError> {
        let (key, body_hash, response) = (key.clone(), body_hash.to_string(), response.clone());
        let subject = key.subject.clone();
        let completion = self
            .blocking(move |s| {
                s.write(|w| w.complete(Kind::Idem, &key, &body_hash, &response, ttl))
            })
            .await?;
        let max_bytes = self.shared.max_bytes;
        if let Completion::TooLarge { bytes } = completion {
            tracing::warn!(
                subject = %subject,
                bytes,
                max_bytes,
                "idempotent result larger than state.idempotency_max_bytes: not stored, a retry runs again"
            );
        }
        Ok(())
    }

    async fn idempotency_release(&self, key: &IdemKey, owner: &str) -> Result<(), StateError> {
        let (scoped, owner) = (key.scoped(), owner.to_string());
        self.blocking(move |s| {
            s.write(|w| {
                if let Some(r) = w.get(Kind::Idem, &scoped)?
                    && matches!(&r.slot, Slot::Running { owner: o, .. } if *o == owner)
                {
                    w.remove(Kind::Idem, &scoped)?;
                }
                Ok(())
            })
        })
        .await
    }

    async fn execution_put(
        &self,
        key: &IdemKey,
        record: &StoredExecution,
        ttl: Duration,
    ) -> Result<(), StateError> {
        let body = serde_json::to_string(record)
            .map_err(|e| StateError::Unavailable(format!("run record: {e}")))?;
        let key = key.clone();
        let subject = key.subject.clone();
        let stored = StoredResponse {
            status: 0,
            body,
            receipt: None,
        };
        let completion = self
            .blocking(move |s| s.write(|w| w.complete(Kind::Exec, &key, "", &stored, ttl)))
            .await?;
        let max_bytes = self.shared.max_bytes;
        if let Completion::TooLarge { bytes } = completion {
            tracing::warn!(
                subject = %subject,
                bytes,
                max_bytes,
                "run record larger than state.idempotency_max_bytes: not kept"
            );
        }
        Ok(())
    }

    async fn execution_get(&self, key: &IdemKey) -> Result<Option<StoredExecution>, StateError> {
        let scoped = key.scoped();
        self.blocking(move |s| {
            let txn = s.db.begin_read()?;
            let table = txn.open_table(EXECS)?;
            let Some(v) = table.get(scoped.as_str())? else {
                return Ok(None);
            };
            let r = decode(&scoped, v.value())?;
            Ok(match r.slot {
                Slot::Done { response, .. } if r.expires_ms > now_ms() => {
                    serde_json::from_str(&response.body).ok()
                }
                _ => None,
            })
        })
        .await
    }

    /// The file answers a read (a failed write or fsync leaves redb refusing every call).
    async fn healthy(&self) -> Result<(), StateError> {
        self.blocking(|s| {
            let txn = s.db.begin_read()?;
            txn.open_table(META)?;
            Ok(())
        })
        .await
    }

    fn kind(&self) -> &'static str {
        "embedded"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TokenKind;
    use redb::ReadableTableMetadata;

    const MAX: usize = 1 << 20;
    const TTL: Duration = Duration::from_secs(60);

    fn key(subject: &str, k: &str) -> IdemKey {
        IdemKey {
            subject: subject.into(),
            key: k.into(),
        }
    }

    fn response(len: usize) -> StoredResponse {
        StoredResponse {
            status: 200,
            body: "x".repeat(len),
            receipt: None,
        }
    }

    fn single_use(jti: &str, exp: u64) -> SingleUse {
        SingleUse {
            kind: TokenKind::Capability,
            jti: jti.into(),
            // After the file's record began (its creation plus the leeway).
            iat: Some(crate::auth::now() + 60),
            exp,
        }
    }

    fn open(dir: &Path) -> DurableStore {
        DurableStore::open(dir, MAX, 5, Duration::ZERO).expect("open the state file")
    }

    fn open_err(dir: &Path) -> String {
        match DurableStore::open(dir, MAX, 5, Duration::ZERO) {
            Ok(_) => panic!("the state file in {} opened", dir.display()),
            Err(e) => e.to_string(),
        }
    }

    fn run(instance: &str, done: bool) -> StoredExecution {
        StoredExecution {
            instance: instance.into(),
            address: Some("http://127.0.0.1:1".into()),
            response: done.then(|| StoredResponse {
                status: 200,
                body: "{\"ok\":true}".into(),
                receipt: None,
            }),
            cancelled_by: None,
            backend: Some("local".into()),
            profile: Some("python".into()),
        }
    }

    /// Rows of `def`, read from the file.
    fn rows(s: &DurableStore, def: TableDefinition<&str, &[u8]>) -> usize {
        let txn = s.shared.db.begin_read().unwrap();
        txn.open_table(def).unwrap().len().unwrap() as usize
    }

    #[tokio::test]
    async fn a_claimed_jti_is_a_replay_after_a_reopen_and_any_old_token_is_claimable() {
        let dir = tempfile::tempdir().unwrap();
        let exp = crate::auth::now() + 300;
        let s = open(dir.path());
        let t = single_use("j1", exp);
        assert_eq!(s.claim_jti(&t).await.unwrap(), JtiClaim::Claimed);
        assert_eq!(s.claim_jti(&t).await.unwrap(), JtiClaim::Replayed);
        let released = single_use("j2", exp);
        assert_eq!(s.claim_jti(&released).await.unwrap(), JtiClaim::Claimed);
        s.release_jti(&released).await.unwrap();
        drop(s);

        let s = open(dir.path());
        assert_eq!(s.claim_jti(&t).await.unwrap(), JtiClaim::Replayed);
        assert_eq!(
            s.claim_jti(&released).await.unwrap(),
            JtiClaim::Claimed,
            "a released id stays usable"
        );
        // Service and capability ids live apart.
        let svc = SingleUse {
            kind: TokenKind::Service,
            ..single_use("j1", exp)
        };
        assert_eq!(s.claim_jti(&svc).await.unwrap(), JtiClaim::Claimed);
        assert_eq!(s.kind(), "embedded");
        s.healthy().await.unwrap();
    }

    #[tokio::test]
    async fn a_new_file_refuses_tokens_that_may_predate_it_and_a_reopen_keeps_its_start() {
        let dir = tempfile::tempdir().unwrap();
        let before = crate::auth::now();
        let s = open(dir.path());
        let since = s.shared.since;
        assert!(
            since > before + 5,
            "the leeway is covered: {before} {since}"
        );
        let early = SingleUse {
            iat: Some(since - 1),
            ..single_use("early", before + 300)
        };
        let no_iat = SingleUse {
            iat: None,
            ..single_use("no-iat", before + 300)
        };
        for t in [&early, &no_iat] {
            assert_eq!(
                s.claim_jti(t).await.unwrap(),
                JtiClaim::PredatesRecord { since }
            );
        }
        assert_eq!(
            s.claim_jti(&SingleUse {
                iat: Some(since),
                ..single_use("on-time", before + 300)
            })
            .await
            .unwrap(),
            JtiClaim::Claimed
        );
        drop(s);
        std::thread::sleep(Duration::from_millis(1100));
        let s = open(dir.path());
        assert_eq!(s.shared.since, since, "a reopen does not move the start");
        assert_eq!(rows_jtis(&s), 1, "refused tokens were not recorded");
    }

    fn rows_jtis(s: &DurableStore) -> usize {
        let txn = s.shared.db.begin_read().unwrap();
        txn.open_table(JTIS).unwrap().len().unwrap() as usize
    }

    #[tokio::test]
    async fn idempotency_claims_and_answers_survive_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let s = open(dir.path());
        let (running, done, released) = (key("svc", "run"), key("svc", "done"), key("svc", "rel"));
        for k in [&running, &done, &released] {
            assert_eq!(
                s.idempotency_begin(k, "h", "old", TTL).await.unwrap(),
                IdemBegin::Started
            );
        }
        assert!(s.idempotency_renew(&running, "old", TTL).await.unwrap());
        assert!(!s.idempotency_renew(&running, "other", TTL).await.unwrap());
        s.idempotency_complete(&done, "h", &response(10), TTL)
            .await
            .unwrap();
        s.idempotency_release(&released, "old").await.unwrap();
        drop(s);

        let s = open(dir.path());
        assert_eq!(
            s.idempotency_begin(&running, "h2", "new", TTL)
                .await
                .unwrap(),
            IdemBegin::InProgress { same_body: false }
        );
        assert_eq!(
            s.idempotency_begin(&done, "h", "new", TTL).await.unwrap(),
            IdemBegin::Done {
                same_body: true,
                response: response(10)
            }
        );
        assert_eq!(
            s.idempotency_begin(&released, "h", "new", TTL)
                .await
                .unwrap(),
            IdemBegin::Started
        );
        // The old owner's claim: renewable by it, not by another; a release by another leaves it,
        // a finished entry stays whoever releases.
        assert!(s.idempotency_renew(&running, "old", TTL).await.unwrap());
        assert!(!s.idempotency_renew(&done, "old", TTL).await.unwrap());
        s.idempotency_release(&running, "new").await.unwrap();
        s.idempotency_release(&done, "old").await.unwrap();
        assert!(matches!(
            s.idempotency_begin(&running, "h", "new", TTL)
                .await
                .unwrap(),
            IdemBegin::InProgress { .. }
        ));
        assert!(matches!(
            s.idempotency_begin(&done, "h", "new", TTL).await.unwrap(),
            IdemBegin::Done { .. }
        ));
        s.idempotency_release(&running, "old").await.unwrap();
        assert_eq!(
            s.idempotency_begin(&running, "h", "new", TTL)
                .await
                .unwrap(),
            IdemBegin::Started
        );
    }

    #[tokio::test]
    async fn a_lapsed_lease_frees_the_key() {
        let dir = tempfile::tempdir().unwrap();
        let s = open(dir.path());
        let k = key("svc", "k");
        let short = Duration::from_millis(1);
        assert_eq!(
            s.idempotency_begin(&k, "h", "a", short).await.unwrap(),
            IdemBegin::Started
        );
        std::thread::sleep(Duration::from_millis(5));
        assert!(!s.idempotency_renew(&k, "a", TTL).await.unwrap());
        assert_eq!(
            s.idempotency_begin(&k, "h", "b", TTL).await.unwrap(),
            IdemBegin::Started
        );
    }

    #[tokio::test]
    async fn run_records_survive_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let s = open(dir.path());
        let (a, b) = (key("svc", "exec-a"), key("svc", "exec-b"));
        s.execution_put(&a, &run("i1", false), TTL).await.unwrap();
        s.execution_put(&a, &run("i1", true), TTL).await.unwrap();
        s.execution_put(&b, &run("i1", false), TTL).await.unwrap();
        drop(s);

        let s = open(dir.path());
        assert_eq!(s.execution_get(&a).await.unwrap(), Some(run("i1", true)));
        assert_eq!(s.execution_get(&b).await.unwrap(), Some(run("i1", false)));
        assert_eq!(
            s.execution_get(&key("other", "exec-a")).await.unwrap(),
            None,
            "another subject's run is not found"
        );
        assert_eq!(rows(&s, EXECS), 2);
    }

    #[tokio::test]
    async fn expired_records_are_ignored_and_swept_from_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let s = open(dir.path());
        let short = Duration::from_millis(1);
        for i in 0..10 {
            let k = key("svc", &format!("k{i}"));
            s.idempotency_begin(&k, "h", "a", TTL).await.unwrap();
            s.idempotency_complete(&k, "h", &response(100), short)
                .await
                .unwrap();
            s.execution_put(&key("svc", &format!("e{i}")), &run("i", true), short)
                .await
                .unwrap();
        }
        // A token that expired long ago (past the leeway and the minute kept after it).
        let old = SingleUse {
            iat: Some(s.shared.since),
            ..single_use("old", crate::auth::now() - 120)
        };
        assert_eq!(s.claim_jti(&old).await.unwrap(), JtiClaim::Claimed);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(s.execution_get(&key("svc", "e0")).await.unwrap(), None);
        assert_eq!(
            s.idempotency_begin(&key("svc", "k0"), "h", "a", TTL)
                .await
                .unwrap(),
            IdemBegin::Started,
            "an expired answer is gone"
        );
        drop(s);

        // Reopening sweeps everything that expired.
        let s = open(dir.path());
        assert_eq!(rows(&s, EXECS), 0);
        assert_eq!(rows(&s, IDEM), 1, "only the running k0 is left");
        let txn = s.shared.db.begin_read().unwrap();
        assert_eq!(rows_jtis(&s), 0);
        assert_eq!(txn.open_table(EXPIRY).unwrap().len().unwrap(), 1);
        let budgets = s.shared.budgets.lock().unwrap();
        assert_eq!((budgets.idem.bytes(), budgets.execs.bytes()), (0, 0));
    }

    #[tokio::test]
    async fn writes_sweep_expired_records_as_they_go() {
        let dir = tempfile::tempdir().unwrap();
        let s = open(dir.path());
        let short = Duration::from_millis(1);
        for i in 0..(SWEEP_BATCH * 2) {
            s.execution_put(&key("svc", &format!("e{i}")), &run("i", true), short)
                .await
                .unwrap();
        }
        std::thread::sleep(Duration::from_millis(5));
        let live = key("svc", "live");
        s.execution_put(&live, &run("i", true), TTL).await.unwrap();
        s.execution_put(&live, &run("i", true), TTL).await.unwrap();
        s.execution_put(&live, &run("i", true), TTL).await.unwrap();
        assert_eq!(rows(&s, EXECS), 1, "each write swept a batch");
    }

    #[tokio::test]
    async fn the_budget_evicts_the_biggest_subjects_oldest_result_and_holds_across_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let body = 1000;
        let unit = result_bytes(
            &key("greedy", "g0").scoped(),
            "greedy",
            "h",
            &"x".repeat(body),
        );
        let max = 4 * unit + unit / 2;
        let s = DurableStore::open(dir.path(), max, 5, Duration::ZERO).unwrap();
        let quiet = key("quietx", "q0");
        s.idempotency_begin(&quiet, "h", "d", TTL).await.unwrap();
        s.idempotency_complete(&quiet, "h", &response(body), TTL)
            .await
            .unwrap();
        let running = key("greedy", "gr");
        s.idempotency_begin(&running, "h", "d", TTL).await.unwrap();
        let greedy: Vec<IdemKey> = (0..10).map(|i| key("greedy", &format!("g{i}"))).collect();
        for g in &greedy {
            s.idempotency_begin(g, "h", "d", TTL).await.unwrap();
            s.idempotency_complete(g, "h", &response(body), TTL)
                .await
                .unwrap();
        }
        drop(s);

        let s = DurableStore::open(dir.path(), max, 5, Duration::ZERO).unwrap();
        let done = |b: &IdemBegin| matches!(b, IdemBegin::Done { .. });
        assert!(done(
            &s.idempotency_begin(&quiet, "h", "d", TTL).await.unwrap()
        ));
        for g in &greedy[..7] {
            let b = s.idempotency_begin(g, "h", "d", TTL).await.unwrap();
            assert_eq!(b, IdemBegin::Started, "{g:?} was evicted");
            s.idempotency_release(g, "d").await.unwrap();
        }
        for g in &greedy[7..] {
            assert!(done(&s.idempotency_begin(g, "h", "d", TTL).await.unwrap()));
        }
        assert_eq!(
            s.idempotency_begin(&running, "h", "d", TTL).await.unwrap(),
            IdemBegin::InProgress { same_body: true },
            "a running entry is never evicted"
        );
        assert_eq!(s.shared.budgets.lock().unwrap().idem.bytes(), 4 * unit);
        // The count was rebuilt from the file: the quiet subject's next result evicts greedy's oldest.
        let q1 = key("quietx", "q1");
        s.idempotency_begin(&q1, "h", "d", TTL).await.unwrap();
        s.idempotency_complete(&q1, "h", &response(body), TTL)
            .await
            .unwrap();
        assert!(done(
            &s.idempotency_begin(&quiet, "h", "d", TTL).await.unwrap()
        ));
        assert_eq!(
            s.idempotency_begin(&greedy[7], "h", "d", TTL)
                .await
                .unwrap(),
            IdemBegin::Started
        );
        // A result larger than the whole budget is not stored and frees its key.
        let big = key("s", "big");
        s.idempotency_begin(&big, "h", "d", TTL).await.unwrap();
        s.idempotency_complete(&big, "h", &response(max), TTL)
            .await
            .unwrap();
        assert_eq!(
            s.idempotency_begin(&big, "h", "d", TTL).await.unwrap(),
            IdemBegin::Started
        );
        drop(s);
        // A lower budget holds from the start on.
        let s = DurableStore::open(dir.path(), unit, 5, Duration::ZERO).unwrap();
        assert!(s.shared.budgets.lock().unwrap().idem.bytes() <= unit);
    }

    #[test]
    fn a_second_opener_of_the_same_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let _first = open(dir.path());
        let e = open_err(dir.path());
        assert!(e.contains(FILE_NAME) && e.contains("in use"), "{e}");
        assert!(
            e.contains(&format!("pid {}", std::process::id())),
            "names the holder: {e}"
        );
    }

    #[test]
    fn an_opener_waits_for_a_holder_that_lets_go_within_the_wait() {
        let dir = tempfile::tempdir().unwrap();
        let first = open(dir.path());
        let letting_go = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            drop(first);
        });
        let second = DurableStore::open(dir.path(), MAX, 5, Duration::from_secs(30));
        letting_go.join().unwrap();
        assert!(second.is_ok(), "{:?}", second.err());
    }

    #[test]
    fn a_corrupt_file_is_an_error_naming_it_and_is_left_as_it_was() {
        let dir = tempfile::tempdir().unwrap();
        let rt = tokio::runtime::Runtime::new().unwrap();
        {
            let s = open(dir.path());
            rt.block_on(async {
                for i in 0..50 {
                    s.execution_put(&key("svc", &format!("e{i}")), &run("i", true), TTL)
                        .await
                        .unwrap();
                }
            });
        }
        let path = dir.path().join(FILE_NAME);
        let mut bytes = std::fs::read(&path).unwrap();
        // Damage every page after the header: the committed trees no longer match their checksums.
        for b in bytes.iter_mut().skip(4096) {
            *b ^= 0x5a;
        }
        std::fs::write(&path, &bytes).unwrap();
        let e = open_err(dir.path());
        assert!(
            e.contains(&path.display().to_string()) && e.contains("move the file aside"),
            "{e}"
        );
        assert_eq!(
            std::fs::read(&path).unwrap(),
            bytes,
            "the file is not reset"
        );

        // Not a redb file at all.
        std::fs::write(&path, b"not a database, but not empty either").unwrap();
        let e = open_err(dir.path());
        assert!(e.contains("corrupt or unreadable"), "{e}");
    }

    #[test]
    fn a_file_of_another_schema_version_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        drop(open(dir.path()));
        {
            let db = Database::create(dir.path().join(FILE_NAME)).unwrap();
            let txn = db.begin_write().unwrap();
            txn.open_table(META)
                .unwrap()
                .insert(SCHEMA_KEY, SCHEMA_VERSION + 1)
                .unwrap();
            txn.commit().unwrap();
        }
        let e = open_err(dir.path());
        assert!(
            e.contains(&format!("schema version {}", SCHEMA_VERSION + 1)),
            "{e}"
        );
        // A redb file that executor-arm did not write.
        let other = tempfile::tempdir().unwrap();
        {
            let db = Database::create(other.path().join(FILE_NAME)).unwrap();
            let txn = db.begin_write().unwrap();
            let t: TableDefinition<&str, u64> = TableDefinition::new("something");
            txn.open_table(t).unwrap().insert("a", 1).unwrap();
            txn.commit().unwrap();
        }
        let e = open_err(other.path());
        assert!(
            e.contains("no schema version") || e.contains("without a schema"),
            "{e}"
        );
    }

    #[test]
    fn the_directory_and_file_are_the_daemons_alone() {
        use std::os::unix::fs::PermissionsExt;
        let base = tempfile::tempdir().unwrap();
        let dir = base.path().join("a/state");
        drop(open(&dir));
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&dir.join(FILE_NAME)), 0o600);
    }

    #[test]
    fn tagged_keys_read_back() {
        for kind in [Kind::Jti, Kind::Idem, Kind::Exec] {
            let t = kind.tagged("3:svc:k:x");
            assert_eq!(Kind::untag(&t), Some((kind, "3:svc:k:x")));
        }
        assert_eq!(Kind::untag("x:k"), None);
        assert_eq!(Kind::untag(""), None);
    }
}
