//! Configuration reload (SIGHUP and `POST /admin/reload`): reads the file again, refuses it
//! whole if it breaks a rule or changes a setting that only a restart applies (see
//! `reload::restart`), and otherwise applies it without dropping a connection: a new
//! pipeline over the same cache, pool and filters, origin limits and breakers changed in
//! place, filters rebuilt only when their source or sizing changed, the certificate read
//! again. It also owns the standalone filters' background tasks, which a reload starts
//! and stops with the filters.

pub mod metrics;
pub mod restart;

pub use restart::RESTART_ONLY;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;

use arc_swap::{ArcSwap, ArcSwapOption};
use tokio::task::AbortHandle;

use crate::fleet::Fleet;
use crate::gate::{Filter, Reconfigure};
use crate::origin::guard::OriginGuard;
use crate::pipeline::Proxy;
use crate::reload::metrics::{ReloadMetrics, ReloadResult};
use crate::stages::{AssembleError, Stages};
use bloomgate_core::config::{Compiled, Config, ConfigError};
use bloomgate_core::db::Db;
use bloomgate_core::report::Chain;

/// Why a reload changed nothing.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// The configuration was given in-process, not read from a file.
    #[error("no configuration file to reload from")]
    NoFile,
    /// The file cannot be read or breaks a rule.
    #[error(transparent)]
    Invalid(#[from] ConfigError),
    /// The file changes settings that only a restart applies.
    #[error("these settings change only with a restart: {}", .0.join(", "))]
    NeedsRestart(Vec<String>),
    /// Applying the file failed before anything was replaced.
    #[error(transparent)]
    Failed(#[from] AssembleError),
}

impl ReloadError {
    fn result(&self) -> ReloadResult {
        match self {
            ReloadError::NoFile | ReloadError::Invalid(_) => ReloadResult::Invalid,
            ReloadError::NeedsRestart(_) => ReloadResult::NeedsRestart,
            ReloadError::Failed(_) => ReloadResult::Failed,
        }
    }
}

/// Reloads a running bloomgate; cheap to clone, shared by the signal handler and the
/// admin plane.
#[derive(Clone)]
pub struct Reloader {
    inner: Arc<Inner>,
}

struct Inner {
    path: Option<PathBuf>,
    /// One reload at a time.
    state: tokio::sync::Mutex<State>,
    proxy: Arc<Proxy>,
    /// The filters in force, for the admin plane.
    filters: ArcSwap<BTreeMap<String, Arc<Filter>>>,
    /// `admin.token` in force.
    token: ArcSwapOption<String>,
    /// The origins' guards in force, for `/admin/origins`.
    origins: ArcSwap<Vec<Arc<OriginGuard>>>,
    metrics: ReloadMetrics,
}

struct State {
    stages: Stages,
    config: Config,
    tasks: FilterTasks,
}

impl Reloader {
    /// A reloader of `config` (read from `path`, when it was) serving through `proxy`,
    /// counting its reloads on `metrics`.
    pub fn new(
        path: Option<PathBuf>,
        stages: Stages,
        config: Config,
        proxy: Arc<Proxy>,
        metrics: ReloadMetrics,
    ) -> Self {
        let filters = ArcSwap::from_pointee(stages.filters.clone());
        let token = ArcSwapOption::new(config.admin.token.clone().map(Arc::new));
        let origins = ArcSwap::from_pointee(guards(&stages));
        Reloader {
            inner: Arc::new(Inner {
                path,
                state: tokio::sync::Mutex::new(State {
                    stages,
                    config,
                    tasks: FilterTasks::default(),
                }),
                proxy,
                filters,
                token,
                origins,
                metrics,
            }),
        }
    }

    /// The filters in force, by name.
    pub fn filters(&self) -> Arc<BTreeMap<String, Arc<Filter>>> {
        self.inner.filters.load_full()
    }

    /// The origins' guards in force.
    pub fn origins(&self) -> Arc<Vec<Arc<OriginGuard>>> {
        self.inner.origins.load_full()
    }

    /// The admin token in force.
    pub fn token(&self) -> Option<Arc<String>> {
        self.inner.token.load_full()
    }

    /// The database pool and the fleet, which do not change while running.
    pub async fn fixed_parts(&self) -> (Option<Db>, Option<Arc<Fleet>>) {
        let state = self.inner.state.lock().await;
        (state.stages.db.clone(), state.stages.fleet.clone())
    }

    /// Starts the loader and the sync loop of every filter (standalone; a fleet runs its
    /// own), and of every filter a reload adds from now on.
    pub async fn start_filter_tasks(&self) {
        let mut state = self.inner.state.lock().await;
        let State { stages, tasks, .. } = &mut *state;
        tasks.running = stages.fleet.is_none() && stages.db.is_some();
        for filter in stages.filters.values() {
            tasks.start(stages, filter);
        }
    }

    /// Stops every filter task.
    pub async fn stop_filter_tasks(&self) {
        let mut state = self.inner.state.lock().await;
        state.tasks.stop_all();
    }

    /// Reads the configuration file again and applies it, or changes nothing. Logs and
    /// counts the result either way. On success, returns what changed.
    pub async fn reload(&self) -> Result<Vec<String>, ReloadError> {
        tracing::info!("reloading the configuration");
        let result = self.try_reload().await;
        self.inner.metrics.record(match &result {
            Ok(_) => ReloadResult::Ok,
            Err(e) => e.result(),
        });
        match &result {
            Ok(changes) => tracing::info!(changes = ?changes, "configuration reloaded"),
            Err(e) => tracing::error!(error = %Chain(e),
                "configuration reload refused; the configuration in force keeps serving"),
        }
        result
    }

    async fn try_reload(&self) -> Result<Vec<String>, ReloadError> {
        let path = self.inner.path.as_deref().ok_or(ReloadError::NoFile)?;
        let mut state = self.inner.state.lock().await;
        let compiled = match Config::load_compiled(path) {
            Ok(c) => c,
            Err(e) => {
                if let (ConfigError::Invalid(problems), Some(tls)) = (&e, &state.stages.tls)
                    && problems.iter().any(|p| p.field.starts_with("server.tls"))
                {
                    // Counted and logged as a failed certificate reload too, as it is one.
                    let _ = tls.reload();
                }
                return Err(e.into());
            }
        };
        let fleet = state.stages.fleet.is_some();
        let mut refused = restart::changed(&state.config, compiled.config());
        let plan = plan_filters(&state.stages.filters, &compiled);
        if fleet {
            refused.extend(plan.fleet_refusals());
        }
        if !refused.is_empty() {
            return Err(ReloadError::NeedsRestart(refused));
        }
        self.apply(&mut state, compiled, plan).await
    }

    async fn apply(
        &self,
        state: &mut State,
        mut compiled: Compiled,
        plan: FilterPlan,
    ) -> Result<Vec<String>, ReloadError> {
        let State {
            stages,
            config,
            tasks,
        } = state;
        // What can fail comes first: nothing is replaced if it does.
        let access_log = stages.access_log_for(compiled.config().access_log.as_ref())?;
        let mut changes = Vec::new();
        if let (Some(tls), Some(new)) = (&stages.tls, compiled.tls.take()) {
            tls.install(new.files, new.certificate);
        }
        changes.extend(stages.set_origins(compiled.config(), compiled.upstream()));
        for (name, settings, action) in plan.actions {
            match action {
                Action::Keep(Reconfigure::Unchanged) => {}
                Action::Keep(_) => {
                    if let Some(filter) = stages.filters.get(&name) {
                        let change = filter.reconfigure(settings.settings);
                        changes.push(format!("filter {name}: {}", describe(change)));
                    }
                }
                Action::Replace | Action::Add => {
                    tasks.stop(&name);
                    let filter = stages.new_filter(&settings);
                    tasks.start(stages, &filter);
                    stages.filters.insert(name.clone(), filter);
                    let what = if matches!(action, Action::Add) {
                        "added"
                    } else {
                        "new source; its routes fail open until it is built"
                    };
                    changes.push(format!("filter {name}: {what}"));
                }
            }
        }
        for name in plan.removed {
            tasks.stop(&name);
            stages.filters.remove(&name);
            changes.push(format!("filter {name}: removed"));
        }
        let routes = compiled.routes().len();
        let (pipeline, new_config) = stages.assemble(compiled, access_log).await?;
        // Requests in flight finish on the old pipeline; its parts go with the last.
        drop(self.inner.proxy.replace(pipeline));
        self.inner.filters.store(Arc::new(stages.filters.clone()));
        self.inner.origins.store(Arc::new(guards(stages)));
        self.inner
            .token
            .store(new_config.admin.token.clone().map(Arc::new));
        *config = new_config;
        changes.push(format!("{routes} routes"));
        Ok(changes)
    }
}

fn guards(stages: &Stages) -> Vec<Arc<OriginGuard>> {
    stages
        .database_guard
        .iter()
        .chain(stages.upstream.as_ref().map(|u| &u.guard))
        .cloned()
        .collect()
}

fn describe(change: Reconfigure) -> &'static str {
    match change {
        Reconfigure::Unchanged => "unchanged",
        Reconfigure::Settings => "settings changed, no rebuild",
        Reconfigure::Rebuild => "rebuilding while the current filter serves",
        Reconfigure::NewSource => "new source",
    }
}

/// What a reload does to one filter.
enum Action {
    /// The same `Filter`, reconfigured as classified.
    Keep(Reconfigure),
    /// A new `Filter` for a new source.
    Replace,
    /// A filter the running configuration does not have.
    Add,
}

/// What a reload does to the filters.
struct FilterPlan {
    actions: Vec<(String, bloomgate_core::config::CompiledFilter, Action)>,
    removed: Vec<String>,
}

impl FilterPlan {
    /// The changes a fleet cannot take by reload: every instance must build from the same
    /// source, so a new source, a new filter or a removed one is rolled out by restart.
    fn fleet_refusals(&self) -> Vec<String> {
        let mut refused: Vec<String> = self
            .actions
            .iter()
            .filter_map(|(name, _, action)| match action {
                Action::Replace => Some(format!("filters.{name} (its source, in fleet mode)")),
                Action::Add => Some(format!("filters.{name} (added, in fleet mode)")),
                Action::Keep(_) => None,
            })
            .collect();
        refused.extend(
            self.removed
                .iter()
                .map(|name| format!("filters.{name} (removed, in fleet mode)")),
        );
        refused
    }
}

fn plan_filters(current: &BTreeMap<String, Arc<Filter>>, compiled: &Compiled) -> FilterPlan {
    let actions = compiled
        .filters()
        .iter()
        .map(|f| {
            let action = match current.get(&f.name) {
                None => Action::Add,
                Some(old) => match Reconfigure::classify(&old.config(), &f.settings) {
                    Reconfigure::NewSource => Action::Replace,
                    keep => Action::Keep(keep),
                },
            };
            (f.name.clone(), f.clone(), action)
        })
        .collect();
    let removed = current
        .keys()
        .filter(|name| !compiled.filters().iter().any(|f| &f.name == *name))
        .cloned()
        .collect();
    FilterPlan { actions, removed }
}

/// The loader and sync tasks of standalone filters, by filter name; aborted when the
/// filter is replaced or removed, and all at shutdown (or when dropped).
#[derive(Default)]
struct FilterTasks {
    /// Tasks run (standalone mode, after the app started running).
    running: bool,
    handles: HashMap<String, [AbortHandle; 2]>,
}

impl FilterTasks {
    fn start(&mut self, stages: &Stages, filter: &Arc<Filter>) {
        let (true, Some(db)) = (self.running, &stages.db) else {
            return;
        };
        let loader = tokio::spawn(Arc::clone(filter).run_loader(db.clone()));
        let sync = tokio::spawn(crate::gate::sync::run(
            Arc::clone(filter),
            Arc::clone(&stages.admit),
            db.clone(),
        ));
        let old = self.handles.insert(
            filter.name().to_owned(),
            [loader.abort_handle(), sync.abort_handle()],
        );
        for task in old.into_iter().flatten() {
            task.abort();
        }
    }

    fn stop(&mut self, name: &str) {
        for task in self.handles.remove(name).into_iter().flatten() {
            task.abort();
        }
    }

    fn stop_all(&mut self) {
        for (_, tasks) in self.handles.drain() {
            for task in tasks {
                task.abort();
            }
        }
    }
}

impl Drop for FilterTasks {
    fn drop(&mut self) {
        self.stop_all();
    }
}
