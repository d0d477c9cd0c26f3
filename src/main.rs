use clap::Parser;
use imcore::cli::{Cli, Command};
use imcore::config::Config;
use imcore::startup::Application;

#[actix_web::main]
async fn main() -> std::process::ExitCode {
    let Cli { config, command } = Cli::parse();
    let result = match command {
        None => serve(config).await,
        Some(Command::Admin(args)) => {
            imcore::admin::run(&args, &config).await.map(|text| println!("{text}")).map_err(|e| e.to_string())
        }
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("imcore: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn serve(config: Config) -> Result<(), String> {
    imcore::telemetry::init(&config.log);
    let app = Application::build(config).await.map_err(|e| e.to_string())?;
    app.run_until_stopped().await.map_err(|e| e.to_string())
}
