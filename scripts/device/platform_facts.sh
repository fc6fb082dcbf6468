#!/usr/bin/env bash
# Issue 22: what a cloud VM guest holding GPUs of an NVSwitch board shows of its platform, and what gpuhealth
# says of it. Run from the repository root on a device machine (carry .whl; see scripts/device/README-style
# notes in BENCHMARKS.md). Everything lands in $OUT (facts.txt, the recording, status/health/qualify JSON).
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
GH="python3 -m gpuhealth.cli.main"
F=$OUT/facts.txt
sec() { printf '\n===== %s\n' "$*" >>"$F"; }
{
sec date; date -u
sec uname; uname -a
sec uptime; cat /proc/uptime
sec systemd-detect-virt; (systemd-detect-virt; systemd-detect-virt -c) 2>&1
sec cpuinfo-hypervisor; grep -c -w hypervisor /proc/cpuinfo; grep -m1 -o -w hypervisor /proc/cpuinfo
sec dmi; for f in /sys/class/dmi/id/{sys_vendor,product_name,board_vendor,bios_vendor,chassis_vendor,product_version}; do printf '%s=' "$f"; cat "$f" 2>&1; done
sec sys-hypervisor; ls -la /sys/hypervisor 2>&1; cat /sys/hypervisor/type 2>&1
sec pci-nvidia; for d in /sys/bus/pci/devices/*; do v=$(cat $d/vendor); [ "$v" = 0x10de ] && echo "$d $(cat $d/device) $(cat $d/class) numa=$(cat $d/numa_node 2>/dev/null) width=$(cat $d/current_link_width 2>/dev/null)"; done
sec pci-all; for d in /sys/bus/pci/devices/*; do echo "$(basename $d) $(cat $d/vendor) $(cat $d/device) $(cat $d/class)"; done
sec lspci; lspci -nn 2>&1 | head -40
sec dev-nvidia; ls -la /dev/nvidia* 2>&1
sec proc-driver; ls -R /proc/driver/nvidia* 2>&1 | head -40
sec nvswitch-sysfs; ls /sys/class/nvidia-nvswitch* /dev/nvidia-nvswitch* 2>&1
sec ns; ls -la /proc/self/ns/ 2>&1; readlink /proc/1/ns/pid /proc/1/ns/net /proc/self/ns/pid /proc/self/ns/net
sec pid1; cat /proc/1/comm; tr '\0' ' ' </proc/1/cmdline; echo
sec cgroup; cat /proc/1/cgroup; cat /proc/self/cgroup
sec container-markers; ls -la /.dockerenv /run/.containerenv 2>&1; env | grep -i -E 'kube|container' 2>&1
sec mounts; head -30 /proc/self/mounts
sec kmsg; (timeout 2 head -c 2000 /dev/kmsg | tail -5) 2>&1; echo "rc=$?"; cat /proc/sys/kernel/dmesg_restrict
sec infiniband; ls -la /sys/class/infiniband 2>&1
sec processes; ps -eo pid,user,comm 2>/dev/null | head -40 || ls /proc | head
sec nvidia-smi; nvidia-smi 2>&1 | head -30
sec nvidia-smi-fabric; nvidia-smi -q 2>&1 | grep -i -A6 fabric | head -40
sec nvidia-smi-topo; nvidia-smi topo -m 2>&1
sec nvidia-smi-nvlink; nvidia-smi nvlink -s 2>&1 | head -40
sec fabricmanager; ls -la /usr/bin/nv-fabricmanager /usr/share/nvidia/nvswitch 2>&1; pgrep -a fabric 2>&1
sec pip; python3 -c "import torch, pynvml, grpc; print(torch.__version__, torch.cuda.device_count(), grpc.__version__)" 2>&1
} >>"$F" 2>&1
cd "$OUT"
sec gpuhealth-record; (cd - >/dev/null; $GH record "$OUT/recording.json") >>"$F" 2>&1; echo "rc=$?" >>"$F"
cd - >/dev/null
sec gpuhealth-status; $GH status --json >"$OUT/status.json" 2>>"$F"; echo "rc=$?" >>"$F"
sec gpuhealth-status-text; $GH status >>"$F" 2>&1; echo "rc=$?" >>"$F"
sec gpuhealth-qualify; s=$(date +%s.%N); $GH qualify --level quick --json >"$OUT/qualify.json" 2>>"$F"; echo "rc=$? wall=$(echo "$(date +%s.%N) - $s" | bc)" >>"$F"
ls -la "$OUT"
