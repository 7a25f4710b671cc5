/*
 * Entry points of the workload guest. One way in, the standard one:
 *
 * _start32: PVH entry (ferry, QEMU -kernel, any PVH loader). 32-bit protected mode, paging
 *           off, %ebx = hvm_start_info. We map the first 4 GiB (RAM below the MMIO hole, the
 *           hole itself with the local APIC) with 2 MiB pages, switch to long mode and call
 *           guest_main; the C code maps RAM above 4 GiB from the memory map.
 * ap_trampoline: where application processors start after INIT/SIPI, in real mode. The BSP
 *           copies it to TRAMPOLINE_ADDR below 1 MiB; it enters protected mode, then long mode
 *           with the BSP's page tables, and calls secondary_main with the local APIC ID.
 */
#define MAPPED_GIB 128
#define MAX_CPUS 16
#define STACK_SIZE 16384
#define TRAMPOLINE_ADDR 0x9000
#define LAPIC_ID_REG 0xfee00020

.macro ENTER_LONG_MODE             /* CR3, PAE, EFER.LME|NXE, paging on (no stack needed) */
    movl $boot_pml4, %eax
    movl %eax, %cr3
    movl $0x20, %eax                /* CR4.PAE */
    movl %eax, %cr4
    movl $0xc0000080, %ecx          /* EFER: LME | NXE */
    rdmsr
    orl $0x900, %eax
    wrmsr
    movl $0x80050033, %eax          /* PG | AM | WP | NE | ET | MP | PE */
    movl %eax, %cr0
.endm

    .section .note.pvh, "a"
    .align 4
    .long 4                 /* name size: "Xen\0" */
    .long 4                 /* desc size */
    .long 18                /* XEN_ELFNOTE_PHYS32_ENTRY */
    .asciz "Xen"
    .long _start32

    .section .text.boot, "ax"
    .code32
    .globl _start32
_start32:
    cli
    movl %ebx, %esi                 /* keep start_info across the switch */
    lgdt gdt_ptr

    /* PML4[0] -> PDPT; PDPT[0..3] -> PD 0..3; PD entries map 2 MiB pages 1:1 (4 GiB). */
    movl $boot_pml4, %edi
    movl $boot_pdpt, %eax
    orl $0x3, %eax
    movl %eax, (%edi)
    xorl %ecx, %ecx
1:  movl %ecx, %eax
    shll $12, %eax
    addl $boot_pd, %eax
    orl $0x3, %eax
    movl %eax, boot_pdpt(,%ecx,8)
    incl %ecx
    cmpl $4, %ecx
    jb 1b

    xorl %ecx, %ecx                 /* ecx = 2 MiB page number */
2:  movl %ecx, %eax
    shll $21, %eax
    orl $0x83, %eax                 /* present, writable, 2 MiB */
    movl %ecx, %edx
    shrl $11, %edx                  /* high 32 bits of the physical address */
    movl %eax, boot_pd(,%ecx,8)
    movl %edx, boot_pd+4(,%ecx,8)
    incl %ecx
    cmpl $(4 * 512), %ecx
    jb 2b

    ENTER_LONG_MODE
    ljmp $0x10, $bsp_long

    .code64
bsp_long:
    leaq stacks+STACK_SIZE(%rip), %rsp
    call load_data_segments
    movl %esi, %edi                 /* guest_main(start_info) */
    call guest_main
    jmp halt

ap_long:
    movl $LAPIC_ID_REG, %edx
    movl (%rdx), %edi
    shrl $24, %edi                  /* this vCPU's APIC ID: its index */
    cmpl $MAX_CPUS, %edi
    jae halt
    movl %edi, %eax
    incl %eax
    imull $STACK_SIZE, %eax
    leaq stacks(%rip), %rsp
    addq %rax, %rsp
    pushq %rdi
    call load_data_segments
    popq %rdi
    call secondary_main
halt:
    hlt
    jmp halt

load_data_segments:
    movl $0x18, %eax
    movw %ax, %ds
    movw %ax, %es
    movw %ax, %ss
    movw %ax, %fs
    movw %ax, %gs
    ret

/* Copied to TRAMPOLINE_ADDR by the BSP; position-dependent on that address. */
    .globl ap_trampoline, ap_trampoline_end
    .code16
ap_trampoline:
    cli
    xorw %ax, %ax
    movw %ax, %ds
    lgdtl TRAMPOLINE_ADDR + (ap_gdt_ptr - ap_trampoline)
    movl %cr0, %eax
    orl $1, %eax
    movl %eax, %cr0
    ljmpl $0x08, $(TRAMPOLINE_ADDR + (ap_protected - ap_trampoline))
    .code32
ap_protected:
    movl $0x18, %eax
    movw %ax, %ds
    movw %ax, %ss
    ENTER_LONG_MODE
    ljmp $0x10, $ap_long
    .align 8
ap_gdt_ptr:
    .word gdt_end - gdt - 1
    .long gdt
ap_trampoline_end:

    .section .rodata
    .align 16
gdt:
    .quad 0                         /* null */
    .quad 0x00cf9a000000ffff        /* 0x08: 32-bit code */
    .quad 0x00af9a000000ffff        /* 0x10: 64-bit code */
    .quad 0x00cf92000000ffff        /* 0x18: data */
    .quad 0x00cff2000000ffff        /* 0x20: user data (DPL 3) */
    .quad 0x00affa000000ffff        /* 0x28: user 64-bit code (DPL 3) */
gdt_end:
gdt_ptr:
    .word gdt_end - gdt - 1
    .long gdt

    .section .bss.pagetables, "aw", @nobits
    .align 4096
    .globl boot_pml4, boot_pdpt, boot_pd
boot_pml4: .skip 4096
boot_pdpt: .skip 4096
boot_pd:   .skip 4096 * MAPPED_GIB

    .section .bss
    .align 16
    .globl stacks
stacks: .skip STACK_SIZE * (MAX_CPUS + 1)
