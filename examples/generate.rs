//! Generate from a Hugging Face model directory:
//!
//! ```text
//! cargo run --release --example generate -- --model DIR --prompt "Hello" [--max-tokens 32]
//!     [--temperature 0.0] [--seed 0]
//! ```
//! Without `--model`, a tiny random-weight demo model is written to a temp dir and used.

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
    let mut model = None;
    let mut prompts = Vec::new();
    let mut params = SamplingParams {
        max_tokens: 32,
        temperature: 0.0,
        ..Default::default()
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => model = Some(value()?),
            "--prompt" => prompts.push(value()?),
            "--max-tokens" => params.max_tokens = value()?.parse()?,
            "--temperature" => params.temperature = value()?.parse()?,
            "--seed" => params.seed = Some(value()?.parse()?),
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    let dir = match model {
        Some(m) => std::path::PathBuf::from(m),
        None => {
            let dir = std::env::temp_dir().join("detspec-example-tiny-model");
            if !dir.join("model.safetensors").exists() {
                write_demo_model(&dir, &DemoModelSpec::tiny())?;
            }
            dir
        }
    };
    if prompts.is_empty() {
        prompts.push("The quick brown fox".into());
    }
    let engine = Engine::from_model_dir(&dir, EngineConfig::default())?;
    let requests = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| Request::new(i.to_string(), p.as_str(), params.clone()))
        .collect();
    for out in engine.generate(requests)? {
        let c = &out.outputs[0];
        println!("{:?} -> {:?}", out.prompt.unwrap_or_default(), c.text);
        println!(
            "  {} tokens, finish: {:?}",
            c.token_ids.len(),
            c.finish_reason
        );
    }
    println!("fingerprint: {}", engine.fingerprint());
    Ok(())
}
