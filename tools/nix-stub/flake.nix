{
  # A stand-in for nixpkgs, for checking flake.nix's wiring offline:
  #   nix flake check --override-input nixpkgs path:./tools/nix-stub
  # It has exactly the attributes flake.nix uses, so a typo or a missing attribute there fails
  # evaluation here; whether nixpkgs itself has them is checked by `nix develop` on a networked
  # machine.
  description = "offline stand-in for the nixpkgs attributes edge-infer's flake uses";
  outputs = { self }:
    let
      system = "x86_64-linux";
      drv = name: derivation { inherit name system; builder = "/bin/sh"; args = [ "-c" "echo > $out" ]; };
      pkgs = {
        python311.withPackages = f: assert builtins.isList (f { nox = drv "nox"; }); drv "python3.11";
        uv = drv "uv";
        gcc = drv "gcc";
        cmake = drv "cmake";
        ninja = drv "ninja";
        git = drv "git";
        util-linux = drv "util-linux";
        podman = drv "podman";
        hadolint = drv "hadolint";
        zlib = drv "zlib";
        libgomp = drv "libgomp";
        stdenv.cc.cc.lib = drv "libstdc++";
        lib.makeLibraryPath = ps: builtins.concatStringsSep ":" (map (p: "${p}/lib") ps);
        mkShell = { packages, env, shellHook }:
          derivation ({ name = "edge-infer-shell"; inherit system shellHook; builder = "/bin/sh";
                        args = [ "-c" "echo > $out" ]; nativeBuildInputs = packages; } // env);
      };
    in
    {
      lib.genAttrs = names: f: builtins.listToAttrs (map (n: { name = n; value = f n; }) names);
      legacyPackages.${system} = pkgs;
    };
}
