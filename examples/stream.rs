//! Streaming with the Rust API: several requests from several threads, each consumed as an
//! iterator of cumulative snapshots, one of them deterministic.
//!
//! ```text
//! cargo run --release --example stream -- [--model DIR]
//! ```

use std::process::ExitCode;

use detspec::demo::{write_demo_model, DemoModelSpec};
use detspec::{Engine, EngineConfig, Request, SamplingParams};

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let dir = match args.iter().position(|a| a == "--model") {
        Some(i) => std::path::PathBuf::from(args.get(i + 1).ok_or("--model needs a value")?),
        None => {
            let dir = std::env::temp_dir().join("detspec-example-tiny-model");
            if !dir.join("model.safetensors").exists() {
                write_demo_model(&dir, &DemoModelSpec::tiny())?;
            }
            dir
        }
    };
    let engine = Engine::from_model_dir(&dir, EngineConfig::default())?;
    let prompts = [
        "The quick brown fox",
        "Deterministic inference means",
        "Once upon a time",
    ];
    std::thread::scope(
        |s| -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
            let handles: Vec<_> = prompts
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let engine = engine.clone();
                    let params = SamplingParams {
                        max_tokens: 24,
                        temperature: 0.8,
                        seed: Some(i as u64),
                        deterministic: i == 0,
                        ..Default::default()
                    };
                    let request = Request::new(format!("r{i}"), *p, params);
                    s.spawn(move || -> Result<String, detspec::DetspecError> {
                        let mut last = String::new();
                        for snapshot in engine.add_request(request)? {
                            let snapshot = snapshot?;
                            let c = &snapshot.outputs[0];
                            println!(
                                "[{}] +{} tokens, text so far {:?}",
                                snapshot.request_id,
                                c.token_ids.len(),
                                c.text
                            );
                            last = format!(
                                "{} (finish: {:?}, rollbacks: {})",
                                c.text, c.finish_reason, snapshot.metrics.num_rollbacks
                            );
                        }
                        Ok(last)
                    })
                })
                .collect();
            for (p, h) in prompts.iter().zip(handles) {
                let text = h.join().map_err(|_| "stream thread panicked")??;
                println!("{p:?} -> {text}");
            }
            Ok(())
        },
    )
    .map_err(|e| e.to_string())?;
    Ok(())
}
