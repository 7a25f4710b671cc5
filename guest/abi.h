/*
 * The contract between the workload guest and a VMM. The ports avoid 0x600-0x63f, where
 * firmware on QEMU's PC machines puts the ACPI PM block (a write to 0x604 can power off). ferry mirrors these numbers in
 * crates/vmm/src/devices/heartbeat.rs; keep both in step.
 */
#ifndef FERRY_GUEST_ABI_H
#define FERRY_GUEST_ABI_H

#define PORT_SERIAL        0x3f8 /* COM1: human-readable progress lines */
#define PORT_REGISTER      0x5a0 /* out32: guest-physical address of this vCPU's hb_block */
#define PORT_HEARTBEAT     0x5a4 /* out32: low 32 bits of the block's seq; counters are in the block */
#define PORT_VERIFY_ERROR  0x5a8 /* out32: working-set page index whose stamp was wrong */
#define PORT_DONE          0x5ac /* out32: this vCPU finished its workload (0) or failed (1) */
#define PORT_FATAL_MSG     0x5b0 /* out8: one byte of a fatal configuration error, '\n' ends it */
#define PORT_BLK_ERROR     0x5b4 /* out32: disk sector whose stamp was wrong, or whose request failed */

#define HB_MAGIC 0x46455259u /* "FERY" */

/* One per vCPU, 128 bytes, in guest memory; the VMM reads it on every heartbeat. */
struct hb_block {
    unsigned long long seq;        /* heartbeats sent by this vCPU */
    unsigned long long pages;      /* pages touched (read or written) */
    unsigned long long passes;     /* completed passes over this vCPU's share */
    unsigned long long errors;     /* verify mismatches seen */
    unsigned long long share_base; /* guest-physical address of this vCPU's first page */
    unsigned long long share_pages;/* pages in this vCPU's share */
    unsigned int cpu;
    unsigned int magic;
    unsigned long long ws_base;    /* guest-physical address of working-set page 0 */
    /* The working set continues past the MMIO hole: pages from ws_split_page on lie at
     * ws_base_high (0: it fits below the hole). */
    unsigned long long ws_split_page;
    unsigned long long ws_base_high;
    /* The blk workload (vCPU 0's block only; 0 elsewhere): requests completed, and sectors
     * whose stamp was wrong or whose request failed. */
    unsigned long long blk_writes;
    unsigned long long blk_reads;
    unsigned long long blk_errors;
    /* The net=fwd workload (vCPU 0's block only; 0 elsewhere): frames the device delivered
     * on the receiveq (well-formed or not), frames posted back on the transmitq, and frames
     * not forwarded (shorter than an Ethernet header, longer than the buffer, or dropped for
     * want of a free tx buffer): net_rx = net_tx + net_errors. */
    unsigned long long net_rx;
    unsigned long long net_tx;
    unsigned long long net_errors;
};

#endif
