//! `onedoor usage report`: which store to read (flag, config file, or the default SQLite file),
//! the time range and grouping from the flags, and the report printed in the chosen format.
//! The queries live in `onedoor-usage`.

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use onedoor_usage::{GroupBy, ReportQuery, StoreUrl, UsageError};

use crate::{problems_text, Failure};

/// The store `usage.store` names when the config has none.
const DEFAULT_STORE: &str = "sqlite://onedoor-usage.db";

#[derive(Args)]
pub struct ReportArgs {
    /// The usage store: sqlite://PATH or postgres://USER@HOST/DB. Default: the `usage.store` of
    /// the file given with --config, else sqlite://onedoor-usage.db (the gateway's default).
    #[arg(long, value_name = "URL")]
    store: Option<String>,
    /// A config file whose `usage.store` to read (used when --store is not given).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Only requests from this time on: YYYY-MM-DD (midnight UTC) or an RFC 3339 time such as
    /// 2026-12-01T09:00:00Z.
    #[arg(long, value_name = "DATE")]
    since: Option<String>,
    /// Only requests before this time: YYYY-MM-DD includes that whole day (UTC); an RFC 3339
    /// time is the exact end.
    #[arg(long, value_name = "DATE")]
    until: Option<String>,
    /// Group by a comma-separated list of tenant, alias, backend, model (the deployment or model
    /// sent upstream), day, month (UTC), kind (batch or request: batch spend beside synchronous
    /// spend). An empty list prints the total only.
    #[arg(long, value_name = "LIST", default_value = "tenant")]
    by: String,
    /// table: aligned columns and a total line; csv: a header and one line per group; json: the
    /// groups and the total as numbers. Each gives requests, input/output/cached/total tokens,
    /// cost in USD, how many requests were estimated (no usage from the upstream), and the
    /// drift of the gateway's token estimate from the measured tokens.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    format: Format,
}

#[derive(Clone, Copy, ValueEnum)]
enum Format {
    Table,
    Csv,
    Json,
}

pub async fn report(args: ReportArgs) -> Result<(), Failure> {
    let store = store(&args)?;
    let query = ReportQuery {
        since_ms: args
            .since
            .as_deref()
            .map(onedoor_usage::parse_since)
            .transpose()
            .map_err(|e| Failure::BadInput(format!("--since: {e}")))?,
        until_ms: args
            .until
            .as_deref()
            .map(onedoor_usage::parse_until)
            .transpose()
            .map_err(|e| Failure::BadInput(format!("--until: {e}")))?,
        by: GroupBy::parse_list(&args.by).map_err(Failure::BadInput)?,
    };
    let report = onedoor_usage::report(&store, &query)
        .await
        .map_err(|error| match error {
            UsageError::Off | UsageError::Missing(_) | UsageError::BadStore => {
                Failure::BadInput(error.to_string())
            }
            error => Failure::Runtime(format!("the usage store {store}: {error}")),
        })?;
    match args.format {
        Format::Table => print!("{}", report.table()),
        Format::Csv => print!("{}", report.csv()),
        Format::Json => println!("{}", report.json()),
    }
    Ok(())
}

fn store(args: &ReportArgs) -> Result<StoreUrl, Failure> {
    let text = match (&args.store, &args.config) {
        (Some(store), _) => store.clone(),
        (None, Some(config)) => {
            onedoor_config::load(config)
                .map_err(|problems| Failure::BadInput(problems_text(&problems)))?
                .usage
                .store
        }
        (None, None) => DEFAULT_STORE.to_owned(),
    };
    StoreUrl::parse(&text).map_err(|e| Failure::BadInput(format!("--store: {e}")))
}
