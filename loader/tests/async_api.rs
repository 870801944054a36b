//! The Rust API from async code: batches as a `Stream`, and the blocking iterator called on a tokio
//! runtime's thread (works on a multi-threaded runtime, a clear error on a current-thread one — never
//! tokio's "cannot block" panic).

#![allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test

use std::path::PathBuf;

use ubdirect_loader::{LoadError, Loader, RunConfig};

fn config(name: &str, samples: u64) -> RunConfig {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let mut cfg = RunConfig::default();
    cfg.dataset.dir = Some(dir);
    cfg.dataset.generate = true;
    cfg.dataset.generate_samples = samples;
    cfg.device.select = ubdirect_ub::DeviceSelection::Host;
    cfg.loader.batch_size = 32;
    cfg
}

/// Sample ids of an epoch, read by the blocking iterator on a plain thread: the reference.
fn reference(cfg: &RunConfig) -> Vec<u64> {
    let loader = Loader::from_config(cfg).unwrap();
    let mut ids = Vec::new();
    for b in loader.epoch(0).unwrap() {
        ids.extend(b.unwrap().samples().iter().map(|s| s.id));
    }
    ids
}

async fn next<S: futures_core::Stream + Unpin>(s: &mut S) -> Option<S::Item> {
    std::future::poll_fn(|cx| std::pin::Pin::new(&mut *s).poll_next(cx)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_delivers_the_same_epoch_as_the_iterator() {
    let cfg = config("async-stream", 1024);
    let want = tokio::task::spawn_blocking({
        let cfg = cfg.clone();
        move || reference(&cfg)
    })
    .await
    .unwrap();
    let loader = Loader::from_config(&cfg).unwrap();
    let mut stream = loader.stream(0).unwrap();
    let mut got = Vec::new();
    while let Some(b) = next(&mut stream).await {
        got.extend(b.unwrap().samples().iter().map(|s| s.id));
    }
    assert_eq!(got.len(), 1024);
    assert_eq!(got, want, "the stream and the iterator deliver one order");
    drop(stream);
    drop(loader); // inside a runtime: must not panic
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocking_iterator_works_on_a_multi_threaded_runtime() {
    let cfg = config("async-blocking-mt", 512);
    let loader = Loader::from_config(&cfg).unwrap();
    let n: usize = loader.epoch(0).unwrap().map(|b| b.unwrap().len()).sum();
    assert_eq!(n, 512);
}

#[tokio::test(flavor = "current_thread")]
async fn blocking_iterator_on_a_current_thread_runtime_is_a_clear_error() {
    let cfg = config("async-blocking-ct", 256);
    let loader = Loader::from_config(&cfg).unwrap();
    let mut it = loader.epoch(0).unwrap();
    match it.next() {
        Some(Err(e @ LoadError::CurrentThreadRuntime)) => {
            let m = e.to_string();
            assert!(m.contains("current-thread"), "{m}");
            assert!(
                m.contains("stream"),
                "the error points at the async API: {m}"
            );
        }
        other => panic!("expected a clear error, got {other:?}"),
    }
    // The async API works right there.
    let mut it = loader.epoch(0).unwrap();
    let mut n = 0;
    while let Some(b) = it.next_async().await {
        n += b.unwrap().len();
    }
    assert_eq!(n, 256);
}
