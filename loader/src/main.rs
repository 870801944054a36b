//! `ubdirect`: the loader's command line. The commands live in `cli/`, out of the library.

mod cli;

fn main() -> std::process::ExitCode {
    cli::main()
}
