use clap::Parser;
use imcore::config::Config;
use imcore::startup::Application;

#[actix_web::main]
async fn main() -> std::process::ExitCode {
    let config = Config::parse();
    imcore::telemetry::init(&config.log);
    let app = match Application::build(config).await {
        Ok(app) => app,
        Err(e) => {
            eprintln!("imcore: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match app.run_until_stopped().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("imcore: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
